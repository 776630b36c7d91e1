"""What keeps a run alive or explains its end: the OOM post-mortem and retry, the elastic
hand-over under torchrun, the peer watch and a rank's last word. Never imports the doctor
or the CLI.
"""
