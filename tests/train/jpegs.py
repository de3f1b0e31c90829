"""JPEG files damaged in the ways files are damaged in the wild: cut short, bits flipped or bytes overwritten in each
of a JPEG's segments and in its entropy-coded scan, segments missing or repeated, bytes before or after, false
dimensions, restart markers out of order; from five JPEGs: baseline 4:2:0, 4:4:4, greyscale, progressive, and
baseline with restart markers.
`damaged()` returns {name: bytes}; some of them libjpeg still decodes (it warns of corrupt data and goes on)."""
import io
import random
from typing import Dict, Tuple

from PIL import Image


def photo(size: Tuple[int, int] = (160, 120), seed: int = 0) -> Image.Image:
    """A photo-like RGB image: smooth gradients and fine noise (every DCT band in use)."""
    rng = random.Random(seed)
    width, height = size
    noise = Image.effect_noise(size, 40).convert('L')
    gradient = Image.linear_gradient('L').resize(size)
    bands = [Image.blend(gradient, noise, 0.3 + 0.2 * rng.random()).rotate(90 * k, expand=False) for k in range(3)]
    return Image.merge('RGB', bands)


def encoded(image: Image.Image, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, 'JPEG', **options)
    return buf.getvalue()


def bases() -> Dict[str, bytes]:
    image = photo()
    return {
        '420': encoded(image, quality=90),
        '444': encoded(image, quality=90, subsampling=0),
        'grey': encoded(image.convert('L'), quality=90),
        'progressive': encoded(image, quality=90, progressive=True, optimize=True),
        'restarts': encoded(image, quality=90, restart_marker_rows=1),
    }


def segments(data: bytes) -> Dict[str, int]:
    """Offsets of the first marker of each kind before the scan data: SOI, APPn, DQT, SOFn, DHT, SOS; and 'scan',
    the first byte of entropy-coded data."""
    found, at = {'SOI': 0}, 2
    names = {0xDB: 'DQT', 0xC4: 'DHT', 0xDA: 'SOS', 0xC0: 'SOF', 0xC2: 'SOF', 0xDD: 'DRI'}
    while at < len(data) - 4 and data[at] == 0xFF:
        marker, length = data[at + 1], int.from_bytes(data[at + 2:at + 4], 'big')
        name = names.get(marker, 'APP' if 0xE0 <= marker <= 0xEF else None)
        if name:
            found.setdefault(name, at)
        if marker == 0xDA:
            found['scan'] = at + 2 + length
            break
        at += 2 + length
    return found


def _flip(data: bytes, at: int, bit: int = 0x10) -> bytes:
    return data[:at] + bytes([data[at] ^ bit]) + data[at + 1:]


def _without(data: bytes, at: int) -> bytes:
    """`data` without the marker segment at `at`."""
    return data[:at] + data[at + 2 + int.from_bytes(data[at + 2:at + 4], 'big'):]


def damaged() -> Dict[str, bytes]:
    out = {}
    for base, data in bases().items():
        where = segments(data)
        scan, end = where['scan'], len(data) - 2  # end: the EOI marker
        out[f'{base}/intact'] = data
        for share in (0.1, 0.5, 0.9):
            out[f'{base}/cut at {share:.0%} of the scan'] = data[:scan + int(share * (end - scan))]
        out[f'{base}/no end marker'] = data[:end]
        out[f'{base}/cut in the headers'] = data[:scan - 20]
        for share in (0.2, 0.5, 0.8):
            at = scan + int(share * (end - scan))
            out[f'{base}/bit flipped at {share:.0%} of the scan'] = _flip(data, at)
            out[f'{base}/16 bytes zeroed at {share:.0%} of the scan'] = data[:at] + bytes(16) + data[at + 16:]
        mid = scan + (end - scan) // 2
        out[f'{base}/scan tail random'] = data[:mid] + random.Random(1).randbytes(end - mid) + data[end:]
        for name in ('DQT', 'SOF', 'DHT', 'SOS'):
            if name in where:
                out[f'{base}/bit flipped in {name}'] = _flip(data, where[name] + 5, 0x01)
        for name in ('DQT', 'DHT'):
            if name in where:
                out[f'{base}/{name} missing'] = _without(data, where[name])
        sof = where['SOF']
        out[f'{base}/height 0'] = data[:sof + 5] + bytes(2) + data[sof + 7:]
        out[f'{base}/height doubled'] = (data[:sof + 5] + (2 * int.from_bytes(data[sof + 5:sof + 7], 'big'))
                                         .to_bytes(2, 'big') + data[sof + 7:])
        out[f'{base}/bytes after the end'] = data + b'trailing bytes of a download' * 4
        out[f'{base}/bytes before the start'] = b'\x00' * 16 + data
        out[f'{base}/scan doubled'] = data[:end] + data[scan:end] + data[end:]
        restart = data.find(b'\xff\xd0', scan)
        if restart > 0:
            out[f'{base}/restart marker out of order'] = data[:restart + 1] + b'\xd5' + data[restart + 2:]
    return out
