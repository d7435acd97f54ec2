"""Storage tier backends (one module per tier); see kvstore.storage for the Tier interface."""
