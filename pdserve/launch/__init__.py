"""`pdserve up`: topology config, process specs, starting/supervising/stopping instances, the demo."""
