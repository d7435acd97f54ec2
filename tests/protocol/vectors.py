"""The test vectors of the draft's appendix, joined as REQUIREMENTS.md explains."""

DESCRIPTOR = {
    "block_tokens": 4,
    "head_dim": 128,
    "kv_dtype": "bf16",
    "kv_heads": 8,
    "layers": 32,
    "layout": "kvsp-layout-1",
    "model": "example-model",
    "model_digest": "sha-256:254e528c669a2084c9727298cacb83e8854e0a6ff80e2bf18096b9dce0f7ebda",
    "positional": "rope",
    "tokenizer_digest": "sha-256:9f42a7a29dca3063ad26d7be7fe6a930fa38afb1a703e4f7ff538db4e133b19c",
}

CANONICAL = (
    '{"block_tokens":4,"head_dim":128,"kv_dtype":"bf16","kv_heads":8,'
    '"layers":32,"layout":"kvsp-layout-1","model":"example-model",'
    '"model_digest":"sha-256:254e528c669a2084c9727298cacb83e8854e0a6f'
    'f80e2bf18096b9dce0f7ebda","positional":"rope","tokenizer_digest"'
    ':"sha-256:9f42a7a29dca3063ad26d7be7fe6a930fa38afb1a703e4f7ff538db'
    '4e133b19c"}'
)

COMPAT_ID = "5ed5c2f238839655d7c4029e12b7f31caf9e7421f4edb4057feee6dab760ee0f"
SCOPE_KEY = bytes(range(32))
SCOPE_ID = "6d1c6481cd428737da312c089db3832a"
TOKENS = [128000, 791, 6460, 374, 264, 1296, 315, 279]
K0 = "9ca9d8b60f37f84726a27deb4cdc0d075714607a131632c2366e30b99fb1163b"
K1 = "653275884ca44f8945fd4c902611c467394b73656e64c78d8522648cb75aefc1"

# Container header for codec raw, layers 0-1, four tokens, K and V of 8192 octets.
HEADER = bytes.fromhex(
    "4b564231 01000001 00000000 00000002 00000004"
    " 0000000000002000 0000000000002000"
    " 0000000000002000 0000000000002000".replace(" ", "")
)
