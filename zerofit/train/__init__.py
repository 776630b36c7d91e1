"""The training process: the loop (loop), the engine, the ranks, resume, the run's files and
metrics, checkpoint saving from the loop, the watchdog. Never imports the doctor or the CLI.
"""
