"""`zerofit generate` and `zerofit chat`: an exported model loaded within a GPU budget (load),
decoded (generate), its offloaded layers streamed from pinned host memory (streaming), and a
whole-GPU model decoded by one compiled step (fastdecode)."""
