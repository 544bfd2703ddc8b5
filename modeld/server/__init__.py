"""The gRPC front end: servicer (conversion + delegation only) and the daemon's lifecycle."""
