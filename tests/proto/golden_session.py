"""The chunks of tests/proto/golden_session.mhasess, the session file the C++
module (proto/mha/v1/session_file.h) writes and the Python client must read
and write byte for byte: the same values as golden_session.h's."""


def golden_chunks(pb):
    """[header, block, block, trailer] as mha.v1.SessionChunk messages."""
    header = pb.SessionHeader(
        format_version=1, session_id="golden-1", model="demo", model_version=2,
        fingerprint=0x0123456789ABCDEF, heads=4, qk_head_dim=64, v_head_dim=64,
        cache_dtype="FP32", position=40, cross=False, max_tokens=4096,
        idle_timeout_ms=600000, idle_left_ms=1234, blocks=2, block_bytes=16)
    return [pb.SessionChunk(header=header),
            pb.SessionChunk(block=bytes(range(16))),
            pb.SessionChunk(block=bytes(range(16, 32))),
            pb.SessionChunk(trailer=pb.SessionTrailer(checksum=0xFEEDFACECAFEBEEF))]
