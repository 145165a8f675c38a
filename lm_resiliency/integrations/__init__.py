"""Stable explicit framework entry points (`lm_resiliency.integrations.<framework>`)."""
