"""Inside one forward pass: the logit lens, the attention over the cache, and the Probe the
decoding loop attaches to record both at each step."""
