"""Checkpoint files: atomic publish, manifest, retention, the DeepSpeed checkpoint engine that
writes them, their size on disk, and readers of DeepSpeed's ZeRO and universal files.
Imports core, config and machine.
"""
