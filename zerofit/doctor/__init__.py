"""`zerofit doctor`: a run directory read into findings and a report.html (run, report),
`--system` checks of the machine, and `--repro` scripts.
"""
