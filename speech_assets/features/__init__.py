"""Stage 2 (pure code): audio decoding, WebRTC VAD, log-mel/MFCC featurisation, the shard format
and builder, and CMVN statistics."""
