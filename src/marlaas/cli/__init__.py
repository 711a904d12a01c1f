"""The `marlaas` command line."""
