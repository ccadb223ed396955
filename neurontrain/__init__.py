"""neurontrain: training on AWS Trainium (torch-xla) with static shapes, cached compiles and portable checkpoints."""

__version__ = "0.1.0"
