"""`zerofit generate` and `zerofit chat`: an exported model run within a GPU budget (generate),
its offloaded layers streamed from pinned host memory (streaming), a whole-GPU model decoded by
one compiled step (fastdecode)."""
