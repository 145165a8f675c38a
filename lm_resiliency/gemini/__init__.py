"""GEMINI: in-memory checkpoints with peer replication and node-local persistence."""
