"""Test machinery (a fault-injecting filesystem, crash campaigns); production never imports it."""
