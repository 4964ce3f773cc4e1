"""KServe V2 gRPC front end (inference.GRPCInferenceService): server, servicer, codec, error mapping."""
