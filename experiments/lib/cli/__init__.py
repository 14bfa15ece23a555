"""The command line of every entry point, checked before Hydra starts (@hydra_preflight)."""
