"""What a trained model needs to leave aiayn: exports to other inference engines."""
