"""The one typed config (schema), read strictly from YAML and --set (load), and its key
reference (reference). Imports only core.
"""
