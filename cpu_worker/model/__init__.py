"""The model both workers build: Llama-family blocks, fused projections, model folders, the weight streamer."""
