"""Scale-from-zero gateway: hold requests while an InferenceService has no Ready pod."""
