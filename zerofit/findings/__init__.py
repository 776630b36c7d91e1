"""Pure functions from a run's timelines to findings: what was measured beside the plan, the
detectors, the fixes named in the run's own terms. The doctor, the watchdog and the OOM
post-mortem read them.
"""
