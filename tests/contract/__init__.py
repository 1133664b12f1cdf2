"""The exchange contract through the public API, on every device this machine has."""
