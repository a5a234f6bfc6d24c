#!/usr/bin/env node
// A second implementation of the fedfleet wire protocol v1 decoder, written from
// protocol/PROTOCOL.md alone (section numbers below are the spec's).
//
//   node decode.js spec PROTOCOL.md
//       decodes every test vector of §12 and checks it against the fields and values printed there;
//       prints {"checks": n} and exits 0, or prints the failures and exits 1.
//   node decode.js capture DIR
//       reads DIR/packets.jsonl (one {"topic", "payload"} per PUBLISH, payload in hex) and DIR/keys.json,
//       verifies and decrypts sealed envelopes (§6), reassembles chunked transfers (§5), decodes every
//       envelope and body (§2-§4), checks receipts' sha256 against what they acknowledge (§3) and the
//       join's manifest hash (§7), and writes DIR/decoded.json. Exits 1 on any violation of the spec.
'use strict';

const fs = require('node:fs');
const crypto = require('node:crypto');
const { decode: mpDecode } = require('@msgpack/msgpack');
const fzstd = require('fzstd');

class SpecError extends Error {}
function fail(msg) { throw new SpecError(msg); }
function hex(u8) { return Buffer.from(u8).toString('hex'); }
function sha256(u8) { return crypto.createHash('sha256').update(u8).digest(); }

// ---------------------------------------------------------------- §2 msgpack reading with offsets

// Strict decode of exactly one msgpack value (the package refuses trailing bytes itself).
function mp(u8, what) {
  try { return mpDecode(u8, { useBigInt64: false }); } catch (e) { fail(`${what}: not one msgpack value (${e.message})`); }
}

// Length in bytes of the msgpack value at u8[pos] (scalars, str, bin only: what the envelope header holds).
function skipScalar(u8, pos) {
  const b = u8[pos];
  if (b <= 0x7f || b >= 0xe0 || b === 0xc2 || b === 0xc3) return 1;
  if (b >= 0xa0 && b <= 0xbf) return 1 + (b & 0x1f);
  const dv = new DataView(u8.buffer, u8.byteOffset, u8.byteLength);
  switch (b) {
    case 0xcc: case 0xd0: return 2;
    case 0xcd: case 0xd1: return 3;
    case 0xce: case 0xd2: case 0xca: return 5;
    case 0xcf: case 0xd3: case 0xcb: return 9;
    case 0xd9: case 0xc4: return 2 + u8[pos + 1];
    case 0xda: case 0xc5: return 3 + dv.getUint16(pos + 1);
    case 0xdb: case 0xc6: return 5 + dv.getUint32(pos + 1);
    default: fail(`envelope: unexpected msgpack byte 0x${b.toString(16)} at ${pos}`);
  }
}

// Split an envelope into its header values, the byte ranges §6 signs (P0, body, P1) and its sec trailer.
function splitEnvelope(u8) {
  const env = mp(u8, 'envelope');
  if (!Array.isArray(env)) fail('envelope: not an array');
  if (env.length < 7) fail(`envelope: ${env.length} elements, at least 7`);
  const head = u8[0];
  if (head !== 0x97 && head !== 0x98) fail(`envelope: array header 0x${head.toString(16)}, expected 97 or 98`);
  let pos = 1;
  for (let i = 0; i < 6; i++) pos += skipScalar(u8, pos);
  const bh = u8[pos];
  const dv = new DataView(u8.buffer, u8.byteOffset, u8.byteLength);
  let bodyStart, bodyLen;
  if (bh === 0xc4) { bodyLen = u8[pos + 1]; bodyStart = pos + 2; }
  else if (bh === 0xc5) { bodyLen = dv.getUint16(pos + 1); bodyStart = pos + 3; }
  else if (bh === 0xc6) { bodyLen = dv.getUint32(pos + 1); bodyStart = pos + 5; }
  else fail('envelope.body: not bin');
  return { env, p0: u8.subarray(0, bodyStart), body: u8.subarray(bodyStart, bodyStart + bodyLen),
           rest: u8.subarray(bodyStart + bodyLen) };
}

function isUint(v) { return typeof v === 'number' && Number.isInteger(v) && v >= 0; }
function isId(s) { return typeof s === 'string' && /^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$/.test(s); }
function isMap(v) { return v !== null && typeof v === 'object' && !Array.isArray(v) && !(v instanceof Uint8Array); }
function scalarMap(v, what) {
  if (!isMap(v)) fail(`${what}: not a map`);
  for (const [k, x] of Object.entries(v)) {
    if (!['number', 'string', 'boolean'].includes(typeof x)) fail(`${what}.${k}: not a scalar`);
  }
  return v;
}

// ---------------------------------------------------------------- §4 tensors

const DTYPES = { 1: ['float32', 4], 2: ['float16', 2], 3: ['float64', 8], 4: ['int64', 8], 5: ['int32', 4],
                 6: ['int16', 2], 7: ['int8', 1], 8: ['uint8', 1], 9: ['bool', 1] };
const FLOAT = new Set([1, 2, 3]);

function half(h) {
  const s = (h & 0x8000) ? -1 : 1, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e === 0) return s * m * 2 ** -24;
  if (e === 31) return m ? NaN : s * Infinity;
  return s * (1 + m / 1024) * 2 ** (e - 15);
}
const f32 = new Float32Array(1), u32 = new Uint32Array(f32.buffer);
function bf16(h) { u32[0] = h << 16; return f32[0]; }
function toDtype(x, dtype) {  // a float32 value converted to the tensor's float dtype
  if (dtype === 1 || dtype === 3) return x;
  return half(floatToHalf(x)); // float16: round the float32 to binary16 (nearest even) and back
}
function floatToHalf(x) {
  f32[0] = x; const u = u32[0];
  const sign = (u >>> 16) & 0x8000; let e = ((u >>> 23) & 0xff) - 127 + 15; let m = u & 0x7fffff;
  if (((u >>> 23) & 0xff) === 0xff) return sign | 0x7c00 | (m ? 0x200 : 0);
  if (e >= 31) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    m |= 0x800000; const shift = 14 - e; let hm = m >> shift; const rem = m & ((1 << shift) - 1), halfway = 1 << (shift - 1);
    if (rem > halfway || (rem === halfway && (hm & 1))) hm++;
    return sign | hm;
  }
  let hm = m >> 13; const rem = m & 0x1fff;
  let h = sign | (e << 10) | hm;
  if (rem > 0x1000 || (rem === 0x1000 && (hm & 1))) h++;
  return h;
}

function readRaw(data, dtype, n) {
  const dv = new DataView(data.buffer, data.byteOffset, data.byteLength);
  const out = new Array(n);
  for (let i = 0; i < n; i++) {
    switch (dtype) {
      case 1: out[i] = dv.getFloat32(4 * i, true); break;
      case 2: out[i] = half(dv.getUint16(2 * i, true)); break;
      case 3: out[i] = dv.getFloat64(8 * i, true); break;
      case 4: out[i] = Number(dv.getBigInt64(8 * i, true)); break;
      case 5: out[i] = dv.getInt32(4 * i, true); break;
      case 6: out[i] = dv.getInt16(2 * i, true); break;
      case 7: out[i] = dv.getInt8(i); break;
      case 8: out[i] = dv.getUint8(i); break;
      case 9: { const b = dv.getUint8(i); if (b > 1) fail('bool tensor: byte not 0 or 1'); out[i] = b === 1; break; }
    }
  }
  return out;
}

function varints(u8, k, n, what) {
  const idx = []; let pos = 0, prev = -1;
  for (let j = 0; j < k; j++) {
    let v = 0n, shift = 0n, len = 0, byte;
    do {
      if (pos >= u8.length) fail(`${what}.indices: truncated varint`);
      byte = u8[pos++]; len++;
      if (len > 10) fail(`${what}.indices: varint longer than 10 bytes`);
      v |= BigInt(byte & 0x7f) << shift; shift += 7n;
    } while (byte & 0x80);
    if (len > 1 && byte === 0) fail(`${what}.indices: non-minimal varint`);
    const d = Number(v);
    if (j > 0 && d < 1) fail(`${what}.indices: not strictly increasing`);
    const i = j === 0 ? d : prev + d;
    if (i >= n) fail(`${what}.indices: index ${i} out of range`);
    idx.push(i); prev = i;
  }
  if (pos !== u8.length) fail(`${what}.indices: bytes after the k-th varint`);
  return idx;
}

function decodeTensor(t, what, { finite = false } = {}) {
  if (!Array.isArray(t) || t.length < 4) fail(`${what}: not a tensor array`);
  const [codecByte, dtype, shape] = t;
  let data = t[3];
  if (!isUint(codecByte) || !isUint(dtype)) fail(`${what}: codec/dtype not uint`);
  if (!DTYPES[dtype]) fail(`${what}.dtype: unknown dtype ${dtype}`);
  if (!Array.isArray(shape) || shape.length > 8 || !shape.every(isUint)) fail(`${what}.shape: bad shape`);
  if (!(data instanceof Uint8Array)) fail(`${what}.data: not bin`);
  const n = shape.reduce((a, b) => a * b, 1);
  if (n > 2 ** 28) fail(`${what}: too many elements`);
  const zstd = (codecByte & 0x80) !== 0, codec = codecByte & 0x7f;
  if (![0, 1, 2, 3, 4].includes(codec)) fail(`${what}.codec: unknown codec ${codecByte}`);
  if (codec !== 0 && !FLOAT.has(dtype)) fail(`${what}.codec: lossy codec on a non-float dtype`);
  const size = DTYPES[dtype][1];
  let k = 0, valueCodec = 0;
  if (codec === 4) {
    k = t[4]; valueCodec = t[5];
    if (!isUint(k) || k > n) fail(`${what}.k: bad k`);
    if (valueCodec !== 0 && valueCodec !== 1) fail(`${what}.value_codec: bad`);
  }
  const expected = { 0: n * size, 1: 2 * n, 2: 2 * n, 3: n, 4: valueCodec === 0 ? k * size : 2 * k }[codec];
  if (zstd) {
    // §4: one zstd frame whose content is the data; decompressed size known in advance
    const out = fzstd.decompress(data);
    if (out.length !== expected) fail(`${what}.data: zstd frame holds ${out.length} bytes, expected ${expected}`);
    data = out;
  }
  if (data.length !== expected) fail(`${what}.data: ${data.length} bytes, expected ${expected}`);
  let values;
  const dv = new DataView(data.buffer, data.byteOffset, data.byteLength);
  if (codec === 0) values = readRaw(data, dtype, n);
  else if (codec === 1) values = Array.from({ length: n }, (_, i) => toDtype(half(dv.getUint16(2 * i, true)), dtype));
  else if (codec === 2) values = Array.from({ length: n }, (_, i) => toDtype(bf16(dv.getUint16(2 * i, true)), dtype));
  else if (codec === 3) {
    const axis = t[4], scalesBin = t[5];
    if (!Number.isInteger(axis) || axis < -1 || axis >= Math.max(shape.length, 0)) fail(`${what}.axis: bad axis ${axis}`);
    if (!(scalesBin instanceof Uint8Array)) fail(`${what}.scales: not bin`);
    const count = axis === -1 ? 1 : shape[axis];
    if (scalesBin.length !== 4 * count) fail(`${what}.scales: ${scalesBin.length / 4} scales, expected ${count}`);
    const sv = new DataView(scalesBin.buffer, scalesBin.byteOffset, scalesBin.byteLength);
    const scales = Array.from({ length: count }, (_, i) => sv.getFloat32(4 * i, true));
    if (!scales.every((s) => Number.isFinite(s) && s >= 0)) fail(`${what}.scales: not finite and >= 0`);
    const inner = axis === -1 ? n : shape.slice(axis + 1).reduce((a, b) => a * b, 1);
    values = new Array(n);
    for (let i = 0; i < n; i++) {
      const q = dv.getInt8(i);
      if (q === -128) fail(`${what}.data: int8 value -128`);
      const s = axis === -1 ? scales[0] : scales[Math.floor(i / inner) % count];
      values[i] = toDtype(Math.fround(q * s), dtype);
    }
  } else {
    const idx = varints(t[6] instanceof Uint8Array ? t[6] : fail(`${what}.indices: not bin`), k, n, what);
    const vals = valueCodec === 0 ? readRaw(data, dtype, k)
      : Array.from({ length: k }, (_, i) => toDtype(half(dv.getUint16(2 * i, true)), dtype));
    values = new Array(n).fill(0);
    idx.forEach((i, j) => { values[i] = vals[j]; });
  }
  if (finite && FLOAT.has(dtype) && !values.every(Number.isFinite)) fail(`${what}: NaN/Inf in a model tensor`);
  return { dtype, shape, values, codec: codecByte };
}

// ---------------------------------------------------------------- §3 bodies

const KINDS = { 1: 'join', 2: 'round_start', 3: 'global', 4: 'update', 5: 'finish', 6: 'status', 7: 'receipt',
                8: 'chunk', 9: 'resend' };
const STATES = ['online', 'offline', 'training', 'idle'];

function bin(v, what, len) {
  if (!(v instanceof Uint8Array)) fail(`${what}: not bin`);
  if (len !== undefined && !(Array.isArray(len) ? len.includes(v.length) : v.length === len)) fail(`${what}: ${v.length} bytes`);
  return { bin: hex(v) };
}
// §3 member sets: form byte 0 = bitmap (bit i mod 8 of byte i div 8), 1 = increasing indices as
// LEB128 deltas (minimal, at most 4 bytes each, a zero delta only first); never empty
const MAX_MEMBER_INDEX = 2 ** 24 - 1;
function memberSet(v, what) {
  const out = bin(v, what);
  if (v.length < 2) fail(`${what}: shorter than 2 bytes`);
  if (v[0] === 0) {
    if (v.length - 1 > (MAX_MEMBER_INDEX >> 3) + 1) fail(`${what}: bitmap too long`);
    if (v.subarray(1).every((b) => b === 0)) fail(`${what}: empty bitmap`);
  } else if (v[0] === 1) {
    let pos = 1, prev = -1, count = 0;
    while (pos < v.length) {
      let d = 0, len = 0, byte;
      do {
        if (pos >= v.length) fail(`${what}: truncated varint`);
        byte = v[pos++]; len++;
        if (len > 4) fail(`${what}: varint longer than 4 bytes`);
        d += (byte & 0x7f) * 2 ** (7 * (len - 1));
      } while (byte & 0x80);
      if (len > 1 && byte === 0) fail(`${what}: non-minimal varint`);
      if (count > 0 && d < 1) fail(`${what}: indices not strictly increasing`);
      prev = count === 0 ? d : prev + d; count++;
      if (prev > MAX_MEMBER_INDEX) fail(`${what}: index ${prev} above ${MAX_MEMBER_INDEX}`);
    }
    if (count > 100000) fail(`${what}: more than 100000 indices`);
  } else fail(`${what}: unknown form ${v[0]}`);
  return out;
}
function str(v, what, max = 1024) { if (typeof v !== 'string' || v.length > max) fail(`${what}: not a str ≤ ${max}`); return v; }
function uint(v, what) { if (!isUint(v)) fail(`${what}: not a uint`); return v; }
function float(v, what) { if (typeof v !== 'number' || !Number.isFinite(v)) fail(`${what}: not a finite number`); return v; }
function bool(v, what) { if (typeof v !== 'boolean') fail(`${what}: not a bool`); return v; }
const codecsSeen = new Set();
function tensorList(v, what) {
  if (!Array.isArray(v) || v.length > 4096) fail(`${what}: not a tensor list`);
  return v.map((t, i) => {
    const d = decodeTensor(t, `${what}[${i}]`, { finite: true }); codecsSeen.add(d.codec);
    return { dtype: d.dtype, shape: d.shape, values: d.values };
  });
}
function extras(v, what) {
  if (!isMap(v) || Object.keys(v).length > 64) fail(`${what}: not a map of ≤ 64 tensors`);
  const out = {};
  for (const [k, t] of Object.entries(v)) {
    if (!/^[A-Za-z0-9_.-]{1,64}$/.test(k)) fail(`${what}: bad name ${k}`);
    const d = decodeTensor(t, `${what}.${k}`, { finite: true }); codecsSeen.add(d.codec);
    out[k] = { dtype: d.dtype, shape: d.shape, values: d.values };
  }
  return out;
}

function decodeBody(kind, u8) {
  const f = mp(u8, 'body');
  if (!Array.isArray(f)) fail('body: not an array');
  const need = { 1: 5, 2: 3, 3: 2, 4: 4, 5: 2, 6: 2, 7: 5, 8: 7, 9: 2 }[kind];
  if (f.length < need) fail(`body: ${f.length} fields, at least ${need}`);
  const b = {};
  switch (kind) {
    case 1:
      b.profile = str(f[0], 'body.profile', 64); b.manifest_hash = str(f[1], 'body.manifest_hash', 128);
      b.num_samples = uint(f[2], 'body.num_samples');
      if (!Array.isArray(f[3])) fail('body.class_histogram: not an array');
      b.class_histogram = f[3].map((c) => uint(c, 'body.class_histogram'));
      b.info = scalarMap(f[4], 'body.info'); break;
    case 2:
      if (!Array.isArray(f[0]) || !f[0].every(isId)) fail('body.selected: not ids');
      b.selected = f[0]; b.deadline_s = float(f[1], 'body.deadline_s');
      if (b.deadline_s <= 0) fail('body.deadline_s: not > 0');
      b.config = scalarMap(f[2], 'body.config');
      if (f.length > 3) b.instructions = scalarMap(f[3], 'body.instructions');
      if (b.instructions && Object.keys(b.instructions).length && b.selected.length !== 1) fail('body.instructions: not for one agent');
      if (f.length > 4 && !(f[4] instanceof Uint8Array && f[4].length === 0)) { // an empty bin: no set
        if (Object.keys(b.instructions).length) fail('body.members: beside instructions');
        b.members = memberSet(f[4], 'body.members');
      } else if (f.length > 4) bin(f[4], 'body.members');
      if (b.instructions && !Object.keys(b.instructions).length) delete b.instructions; // an empty map: absent
      break;
    case 3:
      b.tensors = tensorList(f[0], 'body.tensors'); b.meta = scalarMap(f[1], 'body.meta');
      if (f.length > 2) b.extras = extras(f[2], 'body.extras');
      break;
    case 4:
      b.tensors = tensorList(f[0], 'body.tensors'); b.num_samples = uint(f[1], 'body.num_samples');
      if (b.num_samples < 1) fail('body.num_samples: 0');
      b.train_loss = float(f[2], 'body.train_loss'); b.metrics = scalarMap(f[3], 'body.metrics');
      b.delta = f.length > 4 ? bool(f[4], 'body.delta') : false;
      if (f.length > 5) b.extras = extras(f[5], 'body.extras');
      break;
    case 5: b.reason = str(f[0], 'body.reason'); b.rounds_completed = uint(f[1], 'body.rounds_completed'); break;
    case 6:
      b.state = str(f[0], 'body.state', 32); if (!STATES.includes(b.state)) fail(`body.state: ${b.state}`);
      b.detail = str(f[1], 'body.detail');
      // §3: an online's holdings (global_round, start_round, update_round); ignored beside another state
      ['global_round', 'start_round', 'update_round'].forEach((name, i) => {
        if (f.length > 2 + i) { const v = uint(f[2 + i], `body.${name}`); if (b.state === 'online') b[name] = v; }
      });
      break;
    case 7:
      b.ref_kind = uint(f[0], 'body.ref_kind'); b.ref_seq = uint(f[1], 'body.ref_seq');
      b.accepted = bool(f[2], 'body.accepted'); b.reason = str(f[3], 'body.reason');
      b.sha256 = bin(f[4], 'body.sha256', [0, 32]);
      if (f.length > 5) {
        b.member_index = uint(f[5], 'body.member_index');
        if (b.member_index > MAX_MEMBER_INDEX) fail('body.member_index: too large');
        if (b.ref_kind !== 1 || !b.accepted) delete b.member_index; // meaningless there: ignored
      }
      break;
    case 8: {
      b.transfer_id = bin(f[0], 'body.transfer_id', 16);
      b.index = uint(f[1], 'body.index'); b.count = uint(f[2], 'body.count');
      b.offset = uint(f[3], 'body.offset'); b.total_bytes = uint(f[4], 'body.total_bytes');
      if (b.count < 1 || b.count > 2 ** 20 || b.index >= b.count) fail('body.count/index: out of range');
      b.sha256 = bin(f[5], 'body.sha256', 32); b.data = bin(f[6], 'body.data');
      if (b.offset + f[6].length > b.total_bytes) fail('body.data: overruns total_bytes');
      b._data = f[6]; break;
    }
    case 9:
      b.transfer_id = bin(f[0], 'body.transfer_id', 16);
      if (!Array.isArray(f[1])) fail('body.indices: not an array');
      b.indices = f[1].map((i) => uint(i, 'body.indices')); break;
  }
  return b;
}

// §2: the envelope, unsigned (7 elements) or with its sec trailer as given (checked by the caller)
function decodeEnvelope(u8, plainBody) {
  const parts = splitEnvelope(u8);
  const e = parts.env;
  if (e[0] !== 1) fail(`envelope.version: ${e[0]}`);
  if (!KINDS[e[1]]) fail(`envelope.kind: unknown kind ${e[1]}`);
  if (!isUint(e[2])) fail('envelope.round: not a uint');
  if (!isId(e[3])) fail('envelope.sender: not an id');
  if (!isUint(e[4]) || !isUint(e[5])) fail('envelope.seq/timestamp_ms: not a uint');
  const body = decodeBody(e[1], plainBody || parts.body);
  return { parts, msg: { version: e[0], kind: e[1], round: e[2], sender: e[3], seq: e[4], timestamp_ms: e[5], body } };
}

// ---------------------------------------------------------------- §6 sealed envelopes

const ED_SPKI = Buffer.from('302a300506032b6570032100', 'hex');
const X_SPKI = Buffer.from('302a300506032b656e032100', 'hex');
const ED_PKCS8 = Buffer.from('302e020100300506032b657004220420', 'hex');
const X_PKCS8 = Buffer.from('302e020100300506032b656e04220420', 'hex');
const edPublic = (raw) => crypto.createPublicKey({ key: Buffer.concat([ED_SPKI, raw]), format: 'der', type: 'spki' });
const xPublic = (raw) => crypto.createPublicKey({ key: Buffer.concat([X_SPKI, raw]), format: 'der', type: 'spki' });
const edPrivate = (raw) => crypto.createPrivateKey({ key: Buffer.concat([ED_PKCS8, raw]), format: 'der', type: 'pkcs8' });
const xPrivate = (raw) => crypto.createPrivateKey({ key: Buffer.concat([X_PKCS8, raw]), format: 'der', type: 'pkcs8' });
const rawPublic = (key) => crypto.createPublicKey(key).export({ format: 'der', type: 'spki' }).subarray(12);

function u16be(n) { const b = Buffer.alloc(2); b.writeUInt16BE(n); return b; }
function u64be(n) { const b = Buffer.alloc(8); b.writeBigUInt64BE(BigInt(n)); return b; }
function topicBytes(topic) { const t = Buffer.from(topic, 'utf8'); return Buffer.concat([u16be(t.length), t]); }

function uploadKey(deviceX, serverX, sender, epoch, sharedFrom) {
  const shared = crypto.diffieHellman(sharedFrom);
  const info = Buffer.concat([Buffer.from('fedfleet/v1 upload key\0'), Buffer.from(sender, 'utf8'), Buffer.from([0]),
                              u64be(epoch), deviceX, serverX]);
  return Buffer.from(crypto.hkdfSync('sha256', shared, Buffer.from('fedfleet/v1 hkdf salt'), info, 32));
}

// Open a sealed payload: check the sec trailer, the check bytes, the signature; decrypt. Returns the plaintext body.
function openSealed(u8, topic, parts, signerPub, keyFor) {
  const { env, p0, body, rest } = parts;
  if (env.length !== 8) fail(`sealed envelope: ${env.length} elements`);
  const sec = env[7];
  if (!Array.isArray(sec) || sec.length < 5) fail('sec: not an array of ≥ 5');
  const [epoch, flags, bodyBytes, check] = sec, sig = sec[sec.length - 1];
  if (!isUint(epoch) || epoch < 1 || !isUint(flags) || (flags & ~1) || !isUint(bodyBytes)) fail('sec: bad epoch/flags');
  if (!(check instanceof Uint8Array) || check.length !== 8 || !(sig instanceof Uint8Array) || sig.length !== 64) fail('sec: bad check/signature');
  if (u8[u8.length - 66] !== 0xc4 || u8[u8.length - 65] !== 0x40) fail('sec: signature is not the last 66 bytes');
  if (bodyBytes !== body.length) fail('sec.body_bytes: differs from the body');
  if (!Buffer.from(check.subarray(0, 4)).equals(sha256(Buffer.from(topic, 'utf8')).subarray(0, 4))) fail('sec.check: topic');
  if (!Buffer.from(check.subarray(4, 8)).equals(sha256(body).subarray(0, 4))) fail('sec.check: body');
  const p1 = rest.subarray(0, rest.length - 66);
  const tbs = Buffer.concat([Buffer.from('fedfleet/v1 signature\0'), topicBytes(topic), p0, sha256(body), p1]);
  if (!crypto.verify(null, tbs, signerPub, sig)) fail(`signature does not verify (${topic})`);
  if (!(flags & 1)) return { plain: body, encrypted: false, epoch };
  const key = keyFor(env[3], epoch);
  const nonce = Buffer.concat([Buffer.alloc(4), u64be(env[4])]);
  const aad = Buffer.concat([Buffer.from('fedfleet/v1 aead\0'), topicBytes(topic), p0]);
  const d = crypto.createDecipheriv('aes-256-gcm', key, nonce);
  d.setAAD(aad); d.setAuthTag(body.subarray(body.length - 16));
  try {
    return { plain: Buffer.concat([d.update(body.subarray(0, body.length - 16)), d.final()]), encrypted: true, epoch };
  } catch (e) { fail(`AES-GCM tag does not verify (${topic})`); }
}

// ---------------------------------------------------------------- §7 manifest hash

function canonicalJson(manifest) {
  const s = (x) => JSON.stringify(x).replace(/[\u007f-\uffff]/g, (c) => '\\u' + c.charCodeAt(0).toString(16).padStart(4, '0'));
  return '[' + manifest.map(([n, shape, d]) => `[${s(n)},[${shape.join(',')}],${s(d)}]`).join(',') + ']';
}
function manifestHash(manifest) { return sha256(Buffer.from(canonicalJson(manifest), 'utf8')).toString('hex').slice(0, 16); }

// ---------------------------------------------------------------- output helpers

function clean(msg) {  // the JSON view of §12: chunk data as hex, no private fields
  const body = { ...msg.body }; delete body._data;
  return { ...msg, body };
}
function same(a, b) {
  if (typeof a === 'number' && typeof b === 'number') return Object.is(a, b) || (a === b);
  if (Array.isArray(a) && Array.isArray(b)) return a.length === b.length && a.every((x, i) => same(x, b[i]));
  if (isMap(a) && isMap(b)) {
    const ka = Object.keys(a).sort(), kb = Object.keys(b).sort();
    return same(ka, kb) && ka.every((k) => same(a[k], b[k]));
  }
  return a === b;
}
function flat(x) { return Array.isArray(x) ? x.flatMap(flat) : [x]; }
function shapeOf(x) { return Array.isArray(x) ? [x.length, ...(x.length ? shapeOf(x[0]) : [])] : []; }

// ---------------------------------------------------------------- spec mode

function specMode(path) {
  const text = fs.readFileSync(path, 'utf8');
  let checks = 0; const errors = [];
  const check = (ok, what) => { checks++; if (!ok) errors.push(what); };
  // messages: #### `name` (…) ```hex … ``` ```json … ```
  const unsigned = {};
  const re = /#### `([^`]+)` \([^)]*\)\n\n```hex\n([0-9a-f]+)\n```\n\n```json\n(.*)\n```/g;
  let m;
  while ((m = re.exec(text)) !== null) {
    const [, name, hx, js] = m;
    unsigned[name] = Buffer.from(hx, 'hex');
    try {
      const { msg } = decodeEnvelope(unsigned[name]);
      check(same(clean(msg), JSON.parse(js)), `message ${name}: decoded fields differ:\n${JSON.stringify(clean(msg))}\n${js}`);
    } catch (e) { check(false, `message ${name}: ${e.message}`); }
  }
  check(Object.keys(unsigned).length >= 9, 'fewer than 9 message vectors found');
  // sealed: | `name` | `base` | `topic` | epoch | yes/no | `hex` |
  const keys = Buffer.from(Array.from({ length: 128 }, (_, i) => i));
  const devEd = edPrivate(keys.subarray(0, 32)), devX = xPrivate(keys.subarray(32, 64));
  const srvEd = edPrivate(keys.subarray(64, 96)), srvX = xPrivate(keys.subarray(96, 128));
  const upKey = (text.match(/The upload key of\s+`update-encrypted` \(client-007, epoch 2\) is `([0-9a-f]{64})`/) || [])[1];
  const sre = /^\| `([^`]+)` \| `([^`]+)` \| `([^`]+)` \| (\d+) \| (yes|no) \| `([0-9a-f]+)` \|$/gm;
  let sealedSeen = 0;
  while ((m = sre.exec(text)) !== null) {
    const [, name, base, topic, epoch, enc, hx] = m; sealedSeen++;
    try {
      const u8 = Buffer.from(hx, 'hex');
      const { parts, msg } = (() => { const p = splitEnvelope(u8); return { parts: p, msg: p.env }; })();
      const fromServer = msg[3] === 'server';
      const signer = edPublic(rawPublic(fromServer ? srvEd : devEd));
      const keyFor = (sender, ep) => {
        const k = uploadKey(rawPublic(devX), rawPublic(srvX), sender, ep, { privateKey: srvX, publicKey: xPublic(rawPublic(devX)) });
        check(k.toString('hex') === upKey, `sealed ${name}: derived upload key ${k.toString('hex')} is not the spec's`);
        return k;
      };
      const opened = openSealed(u8, topic, parts, signer, keyFor);
      check(opened.encrypted === (enc === 'yes') && opened.epoch === Number(epoch), `sealed ${name}: flags/epoch`);
      const baseParts = splitEnvelope(unsigned[base]);
      check(Buffer.from(opened.plain).equals(Buffer.from(baseParts.body)), `sealed ${name}: body is not that of ${base}`);
      // the header bytes are those of the unsigned vector but for the array header 98 and the body's bin header
      check(same(parts.env.slice(0, 6), baseParts.env.slice(0, 6)), `sealed ${name}: header fields`);
    } catch (e) { check(false, `sealed ${name}: ${e.message}`); }
  }
  check(sealedSeen >= 3, 'fewer than 3 sealed vectors found');
  // tensors: | `name`[ (decode-only)] | `codec` | `input` | `hex` | `decoded` |
  const tre = /^\| `([^`]+)`( \(decode-only\))? \| `([^`]+)` \| `([^`]+)` \| `([0-9a-f]+)` \| `([^`]+)` \|$/gm;
  let tensorsSeen = 0;
  while ((m = tre.exec(text)) !== null) {
    const [, name, , , , hx, decoded] = m; tensorsSeen++;
    try {
      const want = JSON.parse(decoded);
      const t = decodeTensor(mp(Buffer.from(hx, 'hex'), name), name);
      check(t.dtype === 1 && same(t.shape, shapeOf(want)) && same(t.values, flat(want)), `tensor ${name}: ${JSON.stringify(t.values)}`);
    } catch (e) { check(false, `tensor ${name}: ${e.message}`); }
  }
  check(tensorsSeen >= 13, 'fewer than 13 tensor vectors found');
  // §7 manifest example
  const mm = text.match(/manifest  = (\[.*\])\nhash      = ([0-9a-f]{16})/);
  check(mm && canonicalJson(JSON.parse(mm[1])) === mm[1] && manifestHash(JSON.parse(mm[1])) === mm[2], 'manifest example hash');
  // §4 fp16 encoder rounding of the test vector (float32 → binary16, nearest even)
  check(floatToHalf(Math.fround(0.1)) === 0x2e66 && floatToHalf(1.00048828125) === 0x3c00, 'fp16 rounding');
  return { checks, errors };
}

// ---------------------------------------------------------------- capture mode

function captureMode(dir) {
  const keysJson = JSON.parse(fs.readFileSync(`${dir}/keys.json`, 'utf8'));
  const lines = fs.readFileSync(`${dir}/packets.jsonl`, 'utf8').split('\n').filter(Boolean).map((l) => JSON.parse(l));
  const serverEd = keysJson.server ? edPublic(Buffer.from(keysJson.server.ed25519, 'hex')) : null;
  const serverXPriv = keysJson.server_x25519_private ? xPrivate(Buffer.from(keysJson.server_x25519_private, 'hex')) : null;
  const devices = keysJson.devices || {};
  const out = { envelopes: [], messages: [], receipts_checked: 0, manifest_checked: 0, signed: 0, encrypted: 0,
                chunks: 0, transfers: 0, kinds: {} };
  const transfers = new Map();   // sender|transfer_id -> {buf, got:Set, count, total, sha}
  const received = new Map();    // sender|seq -> sha256 hex of the payload as received (§3)
  const receipts = [];
  for (const { topic, payload } of lines) {
    const u8 = Buffer.from(payload, 'hex');
    if (u8.length === 0) continue; // a cleared retained topic
    const levels = topic.split('/');
    if (levels[0] !== 'fedfleet' || levels[1] !== 'v1') fail(`topic ${topic}: not fedfleet/v1`);
    const direction = levels[3], topicClient = levels.length === 6 ? levels[4] : (direction === 'status' ? levels[4] : null);
    const topicKind = direction === 'status' ? 'status' : levels[levels.length - 1];
    const parts = splitEnvelope(u8);
    let plain = null;
    if (parts.env.length >= 8) {
      if (!Array.isArray(parts.env[7])) fail(`${topic}: envelope element 8 is not sec (§2: the envelope is closed)`);
      const sender = parts.env[3];
      const signer = sender === 'server' ? serverEd : (devices[sender] && edPublic(Buffer.from(devices[sender].ed25519, 'hex')));
      if (!signer) fail(`no key for ${sender}`);
      const opened = openSealed(u8, topic, parts, signer, (s, ep) => uploadKey(
        Buffer.from(devices[s].x25519, 'hex'), Buffer.from(keysJson.server.x25519, 'hex'), s, ep,
        { privateKey: serverXPriv, publicKey: xPublic(Buffer.from(devices[s].x25519, 'hex')) }));
      if (opened.encrypted && sender === 'server') fail('the server never encrypts');
      plain = opened.plain; out.signed++; if (opened.encrypted) out.encrypted++;
    }
    const { msg } = decodeEnvelope(u8, plain);
    if ((direction === 'up' || direction === 'status') && msg.sender !== topicClient) fail(`${topic}: sender ${msg.sender}`);
    if (direction === 'down' && msg.sender !== 'server') fail(`${topic}: sender ${msg.sender}`);
    if (KINDS[msg.kind] !== topicKind && msg.kind !== 8) fail(`${topic}: a ${KINDS[msg.kind]} on a ${topicKind} topic`);
    out.envelopes.push(clean(msg));
    out.kinds[KINDS[msg.kind]] = (out.kinds[KINDS[msg.kind]] || 0) + 1;
    let whole = null, wholeMsg = null, sha = sha256(u8).toString('hex');
    if (msg.kind === 8) {
      out.chunks++;
      const c = msg.body, key = `${msg.sender}|${c.transfer_id.bin}`;
      let t = transfers.get(key);
      if (!t) {
        t = { buf: Buffer.alloc(c.total_bytes), got: new Set(), count: c.count, total: c.total_bytes, sha: c.sha256.bin, L: null, done: false };
        transfers.set(key, t);
      }
      if (c.count !== t.count || c.total_bytes !== t.total || c.sha256.bin !== t.sha) fail(`chunk of ${key}: disagrees with its transfer`);
      const L = c.index < c.count - 1 ? c._data.length : null;
      if (L !== null) { if (t.L === null) t.L = L; else if (t.L !== L) fail('chunk: slice length changes'); }
      if (t.L !== null && c.offset !== c.index * t.L) fail('chunk: offset is not index * L');
      if (t.got.has(c.index)) {
        if (!t.buf.subarray(c.offset, c.offset + c._data.length).equals(Buffer.from(c._data))) fail('chunk: different bytes at a seen index');
        continue;
      }
      Buffer.from(c._data).copy(t.buf, c.offset); t.got.add(c.index);
      if (t.got.size === t.count && !t.done) {
        t.done = true;
        if (sha256(t.buf).toString('hex') !== t.sha) fail(`transfer ${key}: sha256 mismatch`);
        whole = t.buf; out.transfers++;
        const inner = decodeEnvelope(whole);
        if (inner.parts.env.length !== 7) fail('transfer: the inner payload is not an unsigned envelope');
        wholeMsg = inner.msg; sha = sha256(whole).toString('hex');
        if (wholeMsg.sender !== msg.sender || wholeMsg.round !== msg.round || KINDS[wholeMsg.kind] !== topicKind) fail('transfer: inner envelope differs from its chunks');
        out.envelopes.push(clean(wholeMsg));
      }
    } else wholeMsg = msg;
    if (!wholeMsg) continue;
    out.messages.push({ topic, chunked: msg.kind === 8, message: clean(wholeMsg) });
    received.set(`${wholeMsg.sender}|${wholeMsg.seq}`, sha);
    if (wholeMsg.kind === 7) receipts.push({ topic, r: wholeMsg });
    if (wholeMsg.kind === 1 && keysJson.manifest) {
      if (manifestHash(keysJson.manifest) !== wholeMsg.body.manifest_hash) fail(`join of ${wholeMsg.sender}: manifest hash ${wholeMsg.body.manifest_hash} is not that of the manifest`);
      out.manifest_checked++;
    }
  }
  // §3: a receipt's sha256 is that of the acknowledged payload as received; ref_seq is its envelope seq
  for (const { topic, r } of receipts) {
    const levels = topic.split('/');
    const refSender = levels[3] === 'down' ? levels[4] : 'server';
    const want = received.get(`${refSender}|${r.body.ref_seq}`);
    if (want === undefined) fail(`receipt ${r.sender}#${r.seq}: no message ${refSender}#${r.body.ref_seq} was seen`);
    if (r.body.sha256.bin && r.body.sha256.bin !== want) fail(`receipt ${r.sender}#${r.seq}: sha256 is not that of ${refSender}#${r.body.ref_seq}`);
    out.receipts_checked++;
  }
  fs.writeFileSync(`${dir}/decoded.json`, JSON.stringify(out));
  return out;
}

// ---------------------------------------------------------------- main

function main() {
  const [mode, arg] = process.argv.slice(2);
  try {
    if (mode === 'spec') {
      const { checks, errors } = specMode(arg);
      console.log(JSON.stringify({ checks, failures: errors.length }));
      if (errors.length) { console.error(errors.join('\n')); process.exit(1); }
    } else if (mode === 'capture') {
      const o = captureMode(arg);
      console.log(JSON.stringify({ envelopes: o.envelopes.length, messages: o.messages.length, chunks: o.chunks,
                                   transfers: o.transfers, signed: o.signed, encrypted: o.encrypted,
                                   receipts_checked: o.receipts_checked, manifest_checked: o.manifest_checked, kinds: o.kinds,
                                   codecs: [...codecsSeen].sort((a, b) => a - b).map(String) }));
    } else {
      console.error('usage: node decode.js spec PROTOCOL.md | node decode.js capture DIR'); process.exit(2);
    }
  } catch (e) {
    if (e instanceof SpecError) { console.error(`spec violation: ${e.message}`); process.exit(1); }
    throw e;
  }
}

main();
