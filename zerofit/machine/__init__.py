"""What the machine has and how a process uses it: GPU, host RAM, pinned-memory limit and
disk (hardware), the accelerator, the CPU threads of a rank, DeepSpeed's op builds and glibc's
heap. Imports core and config.
"""
