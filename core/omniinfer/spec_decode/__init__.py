"""Speculative decoding: a small draft model proposes k tokens, the target scores them in one
pass, and rejection sampling keeps the target's distribution exactly."""
