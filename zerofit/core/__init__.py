"""The floor every package stands on: errors (ZerofitError), atomic run files and JSON(L)
readers, the memory timeline record and its units, console output, the run lock, the
control group's limits and fault injection. Imports no other zerofit package.
"""
