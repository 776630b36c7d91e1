"""Local files -> rows -> tokenized, loss-masked examples -> packed rows -> per-rank batches,
with the tokenized cache of a run. Imports core, config and machine.
"""
