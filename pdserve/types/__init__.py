"""The shared vocabulary of pdserve, torch-free at import and importing no other pdserve package: sampling and
structured-output params, engine outputs, the engine's configuration and the tensor-parallel layout. Every
layer may import it; it imports nothing of pdserve but itself."""
