/* attnscope views: turning the payload's packed arrays back into numbers.
 *
 * A packed array (payload.schema.json, $defs/packed) is base64 bytes, zlib-compressed when
 * compression is "deflate" (inflated by the browser's own DecompressionStream). uint8 arrays keep
 * their bytes (a view reads byte * scale[layer]); float16 arrays become a Float32Array, uint16 arrays
 * (key positions of the long view) a Uint16Array.
 */
(function (NS) {
  "use strict";

  function base64Bytes(text) {
    if (Uint8Array.fromBase64) return Uint8Array.fromBase64(text);  // native (Chromium 140+, Firefox 133+): 10x the loop
    const binary = atob(text);
    const bytes = new Uint8Array(binary.length);
    for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
    return bytes;
  }

  async function inflate(bytes) {
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Uint8Array(await new Response(stream).arrayBuffer());
  }

  let halfTable = null;
  /* float16 bit pattern -> value, for all 65536 patterns (built once, then decoding is a lookup). */
  function float16Table() {
    if (halfTable) return halfTable;
    halfTable = new Float32Array(65536);
    for (let bits = 0; bits < 65536; bits++) {
      const sign = bits & 0x8000 ? -1 : 1;
      const exponent = (bits >> 10) & 0x1f;
      const fraction = bits & 0x3ff;
      if (exponent === 0) halfTable[bits] = sign * Math.pow(2, -14) * (fraction / 1024);
      else if (exponent === 31) halfTable[bits] = fraction ? NaN : sign * Infinity;
      else halfTable[bits] = sign * Math.pow(2, exponent - 15) * (1 + fraction / 1024);
    }
    return halfTable;
  }

  const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

  function littleEndianUint16(bytes) {
    // the bytes as they lie (every browser's typed arrays are little-endian in practice), when aligned
    if (LITTLE_ENDIAN && bytes.byteOffset % 2 === 0) return new Uint16Array(bytes.buffer, bytes.byteOffset, bytes.length / 2);
    const out = new Uint16Array(bytes.length / 2);
    for (let i = 0; i < out.length; i++) out[i] = bytes[2 * i] | (bytes[2 * i + 1] << 8);
    return out;
  }

  /* Weights [layer, head, q_pos, k_pos] as bytes; byte(l, h, q, k) * scale[l] is the value. */
  class ByteGrid {
    constructor(packed, bytes) {
      this.shape = packed.shape;
      this.bytes = bytes;
      this.scale = packed.scale;
    }
    /* The bytes of one row [k_pos] of (layer, head, q_pos). */
    row(layer, head, query) {
      const [, heads, queries, keys] = this.shape;
      const start = ((layer * heads + head) * queries + query) * keys;
      return this.bytes.subarray(start, start + keys);
    }
    /* The bytes of one matrix [q_pos, k_pos] of (layer, head). */
    matrix(layer, head) {
      const [, heads, queries, keys] = this.shape;
      const start = (layer * heads + head) * queries * keys;
      return this.bytes.subarray(start, start + queries * keys);
    }
    value(layer, byte) {
      return byte * this.scale[layer];
    }
  }

  /* Vectors [layer, head, pos, d_head] as float32. */
  class VectorGrid {
    constructor(packed, values) {
      this.shape = packed.shape;
      this.values = values;
    }
    vector(layer, head, position) {
      const [, heads, positions, size] = this.shape;
      const start = ((layer * heads + head) * positions + position) * size;
      return this.values.subarray(start, start + size);
    }
  }

  async function bytesOf(packed) {
    const bytes = base64Bytes(packed.data);
    return packed.compression === "deflate" ? inflate(bytes) : bytes;
  }

  /* A float16 or uint16 packed array as a flat Float32Array or Uint16Array (C order, packed.shape). */
  async function unpackNumbers(packed) {
    const bits = littleEndianUint16(await bytesOf(packed));
    if (packed.dtype === "uint16") return bits;
    // native float16 (Chromium 135+, Firefox 129+): widened by the typed array constructor, not a loop
    if (typeof Float16Array !== "undefined") return new Float32Array(new Float16Array(bits.buffer, bits.byteOffset, bits.length));
    const table = float16Table();
    const values = new Float32Array(bits.length);
    for (let i = 0; i < bits.length; i++) values[i] = table[bits[i]];
    return values;
  }

  async function unpack(packed) {
    if (packed.dtype === "uint8") return new ByteGrid(packed, await bytesOf(packed));
    return new VectorGrid(packed, await unpackNumbers(packed));
  }

  /* An array [layer, ...] whose layers arrive one at a time (the notebook widget asks the kernel
   * for each): fetchLayer(layer) is a Promise of that layer packed with a leading axis of 1. Reads
   * the same as ByteGrid / VectorGrid, once load(layer) has resolved for the layers read. */
  class LayerGrid {
    constructor(packed, fetchLayer) {
      this.shape = packed.shape;
      this.scale = packed.scale;
      this.fetchLayer = fetchLayer;
      this.pending = new Map(); // layer -> Promise
      this.loaded = new Map(); // layer -> ByteGrid or VectorGrid of that layer alone
    }
    load(layer) {
      if (!this.pending.has(layer)) {
        const done = this.fetchLayer(layer).then(unpack).then((grid) => { this.loaded.set(layer, grid); });
        done.catch(() => this.pending.delete(layer)); // a failed fetch is asked again next time
        this.pending.set(layer, done);
      }
      return this.pending.get(layer);
    }
    row(layer, head, query) { return this.loaded.get(layer).row(0, head, query); }
    matrix(layer, head) { return this.loaded.get(layer).matrix(0, head); }
    vector(layer, head, position) { return this.loaded.get(layer).vector(0, head, position); }
    value(layer, byte) { return byte * this.scale[layer]; }
  }

  /* Rows quantized per row (steps.schema.json $defs/rows): the bytes [..., total], the rows' maxima [..., rows]
   * (float32); a weight is byte / levels * its row's maximum. */
  async function unpackRows(rows) {
    const [values, max] = await Promise.all([bytesOf(rows.values), unpackNumbers(rows.row_max)]);
    return { bytes: values, max, total: rows.values.shape.at(-1), rows: rows.row_max.shape.at(-1), levels: rows.levels };
  }

  NS.LayerGrid = LayerGrid;
  NS.unpack = unpack;
  NS.unpackRows = unpackRows;
  NS.unpackNumbers = unpackNumbers;
})((window.AttnscopeViews = window.AttnscopeViews || {}));
