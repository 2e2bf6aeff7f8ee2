"""The EAGLE-3 drafter: the model and its functional step, attention masks, the training-time-test unroll."""
