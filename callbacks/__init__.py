"""Framework-native surfaces that drive a ResiliencySession (lm_resiliency.callbacks)."""
