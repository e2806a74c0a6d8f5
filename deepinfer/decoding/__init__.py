"""Decoding policies: DSpark speculative decoding and its verification scheduling."""
