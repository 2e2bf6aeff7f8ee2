"""The data stages, one module each (synthesize, merge, regenerate, tokenize, vocab), and what they share."""
