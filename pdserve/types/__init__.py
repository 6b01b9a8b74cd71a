"""The shared vocabulary of pdserve, torch-free and import-free of every other pdserve package: sampling and
structured-output params, engine outputs, the engine's configuration and the tensor-parallel layout. Every
layer may import it; it imports nothing of pdserve but itself."""
