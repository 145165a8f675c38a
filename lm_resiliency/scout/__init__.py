"""SCOUT: failure localization by replay on equivalent peers, timing and out-of-band monitoring."""
