"""What every stage shares: content keys and caching, manifests (the typed contracts between stages), code
fingerprints, atomic files and locks."""
