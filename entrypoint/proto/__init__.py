"""Generated gRPC stubs of serving.proto (regenerate with tools/gen_proto.py)."""
