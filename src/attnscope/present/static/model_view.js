/* attnscope views: the model view, a grid of layers x heads thumbnails.
 *
 * Each thumbnail is the head's [q_pos, k_pos] matrix in the head's colour, opacity = weight. Long
 * inputs are shrunk to the thumbnail's pixels by keeping each pixel's largest weight, so a sharp
 * pattern (a diagonal, one column) stays visible. In causal attention the masked future is grey.
 * Clicking a thumbnail opens that layer and head in the head view. A layer-level measure (no
 * heads; see app.js) gets two columns instead: each layer's own map and the rollout through it,
 * in neutral grey; clicking one opens that layer's map or rollout in the head view.
 */
(function (NS) {
  "use strict";

  const LEFT = 64;
  const TOP = 66; // room for the title, the colour scale and the head numbers
  const GAP = 8;
  const MASKED = [225, 225, 225, 255];

  class ModelView {
    constructor(app, container) {
      this.app = app;
      this.scene = null;
      this.layout = null;
      this.cache = new Map();
      const wrap = NS.element("div", "as-canvas-wrap as-clickable");
      this.surface = new NS.Surface(wrap, "model-canvas");
      this.canvas = this.surface.canvas;
      const hint = app.payload.views.includes("head") ? "Click a thumbnail to open that head in the head view."
        : "Click a thumbnail to select that layer and head.";
      this.hint = NS.element("div", "as-hint", hint);
      this.headHint = hint;
      container.append(this.hint, wrap);
      this.canvas.addEventListener("click", (event) => {
        const hit = this.hit(event);
        if (!hit) return;
        const column = this.columns[hit.head];
        if (column.rollout === undefined) this.app.openHead(hit.layer, hit.head);
        else this.app.openLayer(hit.layer, column.rollout);
      });
      this.canvas.addEventListener("mousemove", (event) => {
        const hit = this.hit(event);
        this.canvas.title = hit ? `layer ${this.app.layerName(hit.layer)}, ${this.columns[hit.head].label} (0-indexed): click to open in the head view` : "";
      });
    }

    sync() {}

    /* The thumbnails' columns: every head of the measure, or a layer-level measure's map and rollout. */
    columnsToDraw() {
      const app = this.app;
      if (app.layerLevel()) {
        return [["layers", "layer map", false], ["rollout", "rollout through it", true]].map(([which, label, rollout]) =>
          ({ id: which, label, rollout, grid: app.mixingGrid(which), head: 0, color: NS.NEUTRAL }));
      }
      const grid = app.grid();
      return Array.from({ length: grid.shape[1] }, (_, head) =>
        ({ id: `head${head}`, label: `head ${head}`, grid, head, color: NS.headColor(head) }));
    }

    computeLayout(grid, columns) {
      const [layers, , queries, keys] = grid.shape;
      const size = Math.max(36, Math.min(96, Math.floor(980 / columns) - GAP));
      return { layers, heads: columns, size, pixelsWide: Math.min(keys, size), pixelsHigh: Math.min(queries, size),
        width: LEFT + columns * (size + GAP) + 8, height: TOP + layers * (size + GAP) + 8 };
    }

    render() {
      const app = this.app;
      const columns = this.columnsToDraw();
      this.columns = columns;
      const layout = this.computeLayout(columns[0].grid, columns.length);
      const axes = app.layerLevel() ? "per layer: its map and the rollout through it (0-indexed)" : "layers x heads (0-indexed)";
      const name = app.layerLevel() ? app.mixingEntry().reference : app.weightName();
      const title = `${app.kind().label} \u00b7 ${axes} \u00b7 ${name}`;
      layout.width = Math.max(layout.width, NS.textWidth(title, 12) * 1.1 + 16, app.layerLevel() ? 520 : 0); // room for title and scale
      this.layout = layout;
      this.hint.textContent = app.layerLevel() ? "Click a thumbnail to open that layer's map (or rollout) in the head view." : this.headHint;
      const scene = new NS.Scene(layout.width, layout.height);
      scene.text(8, 10, title, { size: 12, weight: "bold" });
      this.drawScale(scene);
      columns.forEach((column, index) => {
        scene.text(LEFT + index * (layout.size + GAP) + layout.size / 2, TOP - 10, column.label, { size: 11, align: "center", color: "#555" },
          { role: "column", column: column.id });
      });
      const selected = app.layerLevel() ? (app.state.rollout ? 1 : 0) : app.state.heads.size === 1 ? [...app.state.heads][0] : null;
      for (let layer = 0; layer < layout.layers; layer++) {
        const y = TOP + layer * (layout.size + GAP);
        const window = app.window(layer);
        scene.text(LEFT - 8, y + layout.size / 2 - (window ? 6 : 0), `layer ${app.layerName(layer)}`, { size: 11, align: "right", color: "#555" });
        // a sliding or chunked layer: its window under the name (thumbnails are >= 36 px high, room for two lines)
        const band = app.chunked(layer) ? "chunk" : "window";
        if (window) scene.text(LEFT - 8, y + layout.size / 2 + 7, `${band} ${window}`, { size: 9, align: "right", color: "#8a4b00" });
        for (let head = 0; head < layout.heads; head++) {
          const x = LEFT + head * (layout.size + GAP);
          scene.image(x, y, layout.size, layout.size, this.thumbnail(columns[head], layer, layout),
            { layer, head: app.layerLevel() ? null : head, column: columns[head].id });
          const current = layer === app.state.layer && head === selected;
          scene.rect(x - 0.5, y - 0.5, layout.size + 1, layout.size + 1, { stroke: current ? "#222" : "#ccc", lineWidth: current ? 2 : 1 });
        }
      }
      this.scene = scene;
      this.surface.show(scene);
    }

    /* What the colours mean: each head in its own colour (or grey: no heads), opacity from 0 to the largest value. */
    drawScale(scene) {
      const app = this.app;
      const steps = Array.from({ length: 11 }, (_, i) => ({ fill: "#444", alpha: i / 10 }));
      const top = app.field() === "attention" ? "1" : "the layer's largest";
      const name = app.layerLevel()
        ? `opacity = ${app.mixingEntry().label}, grey: one map per layer, no heads`
        : `opacity = ${app.field() === "norms" ? "\u2016\u03b1f(x)\u2016" : "\u03b1"}, each head in its own colour (head colours as in the head view)`;
      NS.colorScale(scene, 8, 30, steps, ["0", top], name);
    }

    thumbnail(column, layer, layout) {
      const measure = this.app.layerLevel() ? this.app.state.measure : this.app.field();
      const key = `${this.app.state.kind}:${measure}:${layer}:${column.id}:${layout.pixelsWide}x${layout.pixelsHigh}`;
      if (!this.cache.has(key)) this.cache.set(key, this.pool(column.grid, layer, column.head, layout, column.color));
      return this.cache.get(key);
    }

    /* [q_pos, k_pos] bytes -> pixelsHigh x pixelsWide RGBA in `color`, each pixel the largest byte it covers. */
    pool(grid, layer, head, layout, color) {
      const [, , queries, keys] = grid.shape;
      const { pixelsWide: w, pixelsHigh: h } = layout;
      const matrix = grid.matrix(layer, head);
      const peak = new Uint8Array(w * h);
      const columnOf = new Int32Array(keys);
      for (let k = 0; k < keys; k++) columnOf[k] = Math.floor((k * w) / keys);
      for (let q = 0; q < queries; q++) {
        const base = Math.floor((q * h) / queries) * w;
        const row = q * keys;
        for (let k = 0; k < keys; k++) {
          const byte = matrix[row + k];
          if (byte > peak[base + columnOf[k]]) peak[base + columnOf[k]] = byte;
        }
      }
      const [r, g, b] = NS.rgbOf(color);
      const data = new Uint8ClampedArray(w * h * 4);
      const causal = this.app.kind().causal;
      const window = this.app.window(layer);
      const chunked = this.app.chunked(layer);
      for (let y = 0; y < h; y++) {
        const firstQuery = Math.ceil((y * queries) / h); // earliest and latest query this pixel row covers
        const lastQuery = Math.ceil(((y + 1) * queries) / h) - 1;
        for (let x = 0; x < w; x++) {
          const at = (y * w + x) * 4;
          const firstKey = Math.ceil((x * keys) / w);
          const lastKey = Math.ceil(((x + 1) * keys) / w) - 1;
          const unseen = (causal && firstKey > lastQuery)
            || NS.outsideWindow(window, chunked, firstQuery, lastQuery, firstKey, lastKey);
          const color = unseen ? MASKED : [r, g, b, peak[y * w + x]];
          data.set(color, at);
        }
      }
      return { width: w, height: h, data };
    }

    hit(event) {
      if (!this.layout) return null;
      const at = this.surface.at(event);
      const x = at.x - LEFT;
      const y = at.y - TOP;
      const step = this.layout.size + GAP;
      const head = Math.floor(x / step);
      const layer = Math.floor(y / step);
      if (x < 0 || y < 0 || x % step > this.layout.size || y % step > this.layout.size) return null;
      if (head >= this.layout.heads || layer >= this.layout.layers) return null;
      return { layer, head };
    }

    /* For tests: the centre of a thumbnail in viewport coordinates. */
    thumbnailPoint(layer, head) {
      const step = this.layout.size + GAP;
      return this.surface.point(LEFT + head * step + this.layout.size / 2, TOP + layer * step + this.layout.size / 2);
    }
  }

  NS.ModelView = ModelView;
})((window.AttnscopeViews = window.AttnscopeViews || {}));
