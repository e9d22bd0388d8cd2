"""tierd's service: settings, the REST API, the CLI and the Python client."""
