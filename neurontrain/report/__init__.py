"""Looking at runs: `neurontrain report` (one HTML page, plots inlined as SVG) and `neurontrain compare` (parity
of two runs with a tolerance, throughput and cost). Pure logic in `series`, `comparison`, `prices`; files in
`runs`; drawing in `plots` and `page`."""
