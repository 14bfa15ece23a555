"""The decoding methods and their drafters, the prompts a decoding run takes, its checks, calibration."""
