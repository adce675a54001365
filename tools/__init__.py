"""Developer tools (mutation testing): run from a checkout, not installed with the package."""
