"""NVMe offload (ZeRO-Infinity) that works or says why before it starts: the swapper's layout
byte by byte, the aio sweep, the swap directory's checks. Imports the floors below it.
"""
