"""The id strategies; each takes its store as an object meeting a protocol."""
