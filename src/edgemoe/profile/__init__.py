"""Routing profiles: router samples and the statistics derived from them (numpy core)."""

from .store import Profile, ProfileMeta, build_profile, load_profile, synthetic_profile

__all__ = ["Profile", "ProfileMeta", "build_profile", "load_profile", "synthetic_profile"]
