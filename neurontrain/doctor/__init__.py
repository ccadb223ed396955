"""`neurontrain doctor`: the Neuron contracts the toolkit relies on, checked end to end on this host.

report.py is the JSON schema and the table; verdicts.py the pure pass/fail logic over what a check measured;
context.py the scratch runs the checks share (each run once, whichever check asks first); checks.py the checks.
"""
