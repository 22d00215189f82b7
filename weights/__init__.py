"""From a Hugging Face checkpoint to pre-sharded, verified weight packs, and back onto a device."""
