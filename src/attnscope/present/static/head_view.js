/* attnscope views: the head view.
 *
 * Attending tokens (queries) on the left, attended tokens (keys) on the right; a line per
 * (head, query, key) with opacity = weight in the head's colour. Lines whose weight rounds to 0
 * of 255 are invisible and not drawn; without hovering, long inputs show only their strongest
 * LINE_BUDGET lines (the caption gives the cut-off). Hovering a token draws all of its lines and
 * writes the weights beside the other column. A layer-level measure (ALTI, GlobEnc, value
 * zeroing, ...; see app.js) has no heads: its lines are one set in neutral grey, and the head
 * squares give way to a legend that says so.
 */
(function (NS) {
  "use strict";

  const SIDE_SPACE = 120; // room for the weights written beside a column while hovering
  const LINE_GAP = 220; // width of the band the lines cross
  const SINK_LINE = 18; // height of the learned sink's line under the tokens (models with learned sinks)
  const TOP = 50;
  // Without hovering, at most this many lines are drawn (the strongest; the caption says so):
  // a long input has ~10^6 nonzero weights and long lines are slow to rasterize.
  const LINE_BUDGET = 40000;
  const FILTERS = [["all", "all"], ["AA", "A \u2192 A"], ["AB", "A \u2192 B"], ["BA", "B \u2192 A"], ["BB", "B \u2192 B"]];

  const element = NS.element;

  /* The heads shown after double-clicking `head`: only it, or all `count` heads if it was already alone. */
  NS.soloHeads = function soloHeads(shown, head, count) {
    const alone = shown.size === 1 && shown.has(head);
    return alone ? new Set(Array.from({ length: count }, (_, h) => h)) : new Set([head]);
  };

  /* Whether no query of firstQuery..lastQuery sees any key of firstKey..lastKey through a window of `window` keys
     (causality aside): a sliding one (|q - k| < window) or, `chunked`, a chunk (q // window == k // window). */
  NS.outsideWindow = function outsideWindow(window, chunked, firstQuery, lastQuery, firstKey, lastKey) {
    if (!window) return false;
    if (chunked) {
      const chunk = (pos) => Math.floor(pos / window);
      return chunk(lastKey) < chunk(firstQuery) || chunk(firstKey) > chunk(lastQuery);
    }
    return firstQuery - lastKey >= window || firstKey - lastQuery >= window;
  };

  /* The caption of a layer's window: "sliding window: 4 keys", "chunks of 4 keys", "" without one. */
  NS.windowText = function windowText(window, chunked) {
    return !window ? "" : chunked ? `chunks of ${window} keys` : `sliding window: ${window} keys`;
  };

  class HeadView {
    constructor(app, container) {
      this.app = app;
      this.container = container;
      this.hover = null; // {side: "query" | "key", pos}
      this.scene = null;
      this.layout = null;
      const controls = element("div", "as-controls");
      [this.filterLabel, this.filter] = NS.control("select", "Sentences", "filter");
      for (const [value, text] of FILTERS) this.filter.append(new Option(text, value));
      [this.specialLabel, this.hideSpecial] = NS.control("checkbox", "hide special tokens", "hide-special");
      this.swatches = element("div", "as-swatches");
      this.swatches.title = "click: show or hide a head; double-click: show only that head (again: all heads)";
      this.legend = element("span", "as-hint");
      this.legend.dataset.role = "measure-legend";
      controls.append(this.filterLabel, this.specialLabel, this.swatches, this.legend);
      const wrap = element("div", "as-canvas-wrap");
      this.surface = new NS.Surface(wrap, "head-canvas");
      this.canvas = this.surface.canvas;
      container.append(controls, wrap);
      this.filter.addEventListener("change", () => { app.state.filter = this.filter.value; this.render(); });
      this.hideSpecial.addEventListener("change", () => { app.state.hideSpecial = this.hideSpecial.checked; this.render(); });
      this.canvas.addEventListener("mousemove", (event) => this.onMove(event));
      this.canvas.addEventListener("mouseleave", () => this.setHover(null));
      // clicking a query token selects it (its lines stay shown); clicking it again clears the selection;
      // then clicking a key token hands the cell (selected query, key) to app.onCell, where the page gives one
      this.canvas.addEventListener("click", () => {
        if (this.hover && this.hover.side === "query" && app.selectToken) {
          app.selectToken(app.state.selected === this.hover.pos ? null : this.hover.pos);
        } else if (this.hover && this.hover.side === "key" && app.onCell && Number.isInteger(app.state.selected)) {
          app.onCell(app, app.state.selected, this.hover.pos);
        }
      });
    }

    /* Controls that depend on the kind of attention: the pair filter, the special toggle, head swatches. */
    sync() {
      const kind = this.app.kind();
      const sides = this.app.payload.sides;
      const pair = kind.query_side === kind.key_side && sides[kind.query_side].sentence.includes(1);
      if (!pair) this.app.state.filter = "all";
      this.filterLabel.hidden = !pair;
      this.filter.value = this.app.state.filter;
      const anySpecial = sides[kind.query_side].special.includes(true) || sides[kind.key_side].special.includes(true);
      this.specialLabel.hidden = !anySpecial;
      this.hideSpecial.checked = this.app.state.hideSpecial;
      const layerLevel = this.layerLevel();
      this.swatches.style.display = layerLevel ? "none" : ""; // (the stylesheet's display: flex beats hidden)
      this.legend.hidden = !layerLevel;
      this.writeLegend();
      this.buildSwatches();
    }

    /* What the grey lines are (the measure's name arrives with it when the explorer fetches it). */
    writeLegend() {
      if (!this.layerLevel()) return;
      const entry = this.app.mixingEntry();
      const name = entry ? entry.label : this.app.state.measure;
      this.legend.textContent = `grey lines: ${name}, one map per layer (it has no heads); opacity = value / the layer's largest`;
    }

    /* A layer-level measure is drawn (the long view's window app has none). */
    layerLevel() { return !!this.app.layerLevel && this.app.layerLevel(); }
    /* The (pseudo-)heads whose lines are drawn and their colour. */
    lineHeads() { return this.app.lineHeads ? this.app.lineHeads() : [...this.app.state.heads].sort((a, b) => a - b); }
    lineColor(head) { return this.app.lineColor ? this.app.lineColor(head) : NS.headColor(head); }

    buildSwatches() {
      const heads = this.app.nHeads();
      this.swatches.replaceChildren();
      for (let head = 0; head < heads; head++) {
        const swatch = element("span", "as-swatch", String(this.headName(head)));
        swatch.dataset.head = String(head);
        swatch.style.background = NS.headColor(head);
        swatch.title = `head ${this.headName(head)} (0-indexed): click to show/hide, double-click to show only this head (again: all heads)`;
        swatch.addEventListener("click", () => this.app.toggleHead(head));
        swatch.addEventListener("dblclick", () => this.app.soloHead(head));
        this.swatches.append(swatch);
      }
      this.paintSwatches();
    }

    /* The model's number of head `head` (the long view's window may hold a subset of the heads). */
    headName(head) {
      return this.app.headName ? this.app.headName(head) : head;
    }

    paintSwatches() {
      for (const swatch of this.swatches.children) {
        swatch.classList.toggle("as-off", !this.app.state.heads.has(Number(swatch.dataset.head)));
      }
    }

    /* Positions shown in a column after the sentence filter and the special-token toggle. */
    positions(which) {
      const kind = this.app.kind();
      const side = this.app.payload.sides[which === "query" ? kind.query_side : kind.key_side];
      const filter = this.app.state.filter;
      const wanted = filter === "all" ? null : (filter[which === "query" ? 0 : 1] === "A" ? 0 : 1);
      const shown = [];
      for (let pos = 0; pos < side.tokens.length; pos++) {
        if (this.app.state.hideSpecial && side.special[pos]) continue;
        if (wanted !== null && side.sentence[pos] !== wanted) continue;
        shown.push(pos);
      }
      return { side, shown };
    }

    computeLayout(left, right) {
      const rows = Math.max(left.shown.length, right.shown.length, 1);
      const rowHeight = Math.max(6, Math.min(rows > 100 ? 15 : 20, 30000 / rows));
      const size = Math.min(13, Math.max(6, rowHeight - 4));
      const widest = (column) => Math.min(170, Math.max(20, ...column.shown.map((p) => NS.textWidth(NS.label(column.side.tokens[p], 24), size))));
      const leftText = widest(left);
      const rightText = widest(right);
      const leftEdge = SIDE_SPACE + leftText; // left tokens end here (right-aligned)
      const lineStart = leftEdge + 6;
      const lineEnd = lineStart + LINE_GAP;
      const rightStart = lineEnd + 6;
      const width = rightStart + rightText + SIDE_SPACE;
      return { rowHeight, size, leftEdge, lineStart, lineEnd, rightStart, rightText, width,
        height: TOP + rows * rowHeight + 8, left, right };
    }

    rowY(layout, row) {
      return TOP + row * layout.rowHeight + layout.rowHeight / 2;
    }

    render() {
      const app = this.app;
      const grid = app.grid();
      const layer = app.state.layer;
      const left = this.positions("query");
      const right = this.positions("key");
      const layout = this.computeLayout(left, right);
      if (this.sinkShown()) layout.height += SINK_LINE; // room for the learned sink's line
      layout.width = Math.max(layout.width, NS.textWidth(this.captionText(), 12) * 1.1 + 16); // bold is wider
      this.layout = layout;
      const scene = new NS.Scene(layout.width, layout.height);
      this.drawTokens(scene, layout);
      this.drawLines(scene, layout, grid, layer);
      this.drawCaption(scene, layout);
      if (this.focus()) this.drawWeights(scene, layout, grid, layer);
      this.drawSink(scene, layout, layer);
      this.scene = scene;
      this.drawnWith = { grid, layer }; // what drawnLines() reads weights from
      this.surface.show(scene);
      this.writeLegend();
      this.paintSwatches();
    }

    captionText() {
      const app = this.app;
      const heads = [...app.state.heads].sort((a, b) => a - b).map((head) => this.headName(head));
      const shownHeads = this.layerLevel() ? "no heads (a layer-level measure), grey" : heads.length === app.nHeads() ? "all heads"
        : heads.length === 1 ? `head ${heads[0]}` : `heads ${heads.join(", ") || "none"}`;
      const window = NS.windowText(app.window(app.state.layer), app.chunked(app.state.layer));
      const slide = window ? ` \u00b7 ${window}` : "";
      return `${app.kind().label} \u00b7 layer ${app.layerName(app.state.layer)}${slide} \u00b7 ${shownHeads} (0-indexed) \u00b7 ${app.weightName()}`;
    }

    drawCaption(scene, layout) {
      const app = this.app;
      scene.text(8, 10, this.captionText(), { size: 12, weight: "bold" });
      if (this.minByte > 1) {
        scene.text(8, 26, `showing the ${this.drawn} strongest of ${this.total} lines (weight \u2265 ${app.formatWeight(app.grid().value(app.state.layer, this.minByte))}); hover a token to see all of its lines`,
          { size: 11, color: "#8a4b00" });
      }
      scene.text(layout.leftEdge, TOP - 10, "attending (query)", { size: 11, color: "#666", align: "right" });
      scene.text(layout.rightStart, TOP - 10, "attended (key)", { size: 11, color: "#666" });
    }

    drawTokens(scene, layout) {
      const causal = this.app.kind().causal;
      const layer = this.app.state.layer;
      const window = this.app.window(layer);
      const chunked = this.app.chunked(layer);
      const hover = this.focus();
      const columns = [["query", layout.left, layout.leftEdge, "right"], ["key", layout.right, layout.rightStart, "left"]];
      for (const [which, column, x, align] of columns) {
        column.shown.forEach((pos, row) => {
          const y = this.rowY(layout, row);
          const hovered = hover && hover.side === which && hover.pos === pos;
          if (hovered) {
            const width = NS.textWidth(NS.label(column.side.tokens[pos], 24), layout.size) + 6;
            scene.rect(align === "right" ? x - width + 3 : x - 3, y - layout.rowHeight / 2 + 1, width, layout.rowHeight - 2,
              { fill: "#ffe9a8" });
          }
          // in causal attention a query sees no later key, on a sliding or chunked layer none beyond its window:
          // grey those out while hovering
          const [query, key] = hover ? (which === "key" ? [hover.pos, pos] : [pos, hover.pos]) : [0, 0];
          const masked = hover && hover.side !== which
            && ((causal && query < key) || NS.outsideWindow(window, chunked, query, query, key, key));
          scene.text(x, y, NS.label(column.side.tokens[pos], 24),
            { size: layout.size, align, color: masked ? "#bbb" : column.side.special[pos] ? "#777" : "#222" },
            { role: "token", side: which, pos });
        });
      }
    }

    /* Lines batched by (head, byte): one batch per colour and opacity keeps 512 tokens x 12 heads fast. */
    drawLines(scene, layout, grid, layer) {
      const hover = this.focus();
      const pick = (column, side) => column.shown.map((pos, row) => [pos, this.rowY(layout, row)])
        .filter(([pos]) => !hover || hover.side !== side || hover.pos === pos);
      const left = pick(layout.left, "query");
      const right = pick(layout.right, "key");
      const keys = Int32Array.from(right, ([pos]) => pos);
      const keyY = Float64Array.from(right, ([, y]) => y);
      const heads = this.lineHeads();
      const layerLevel = this.layerLevel();
      const histogram = new Float64Array(256);
      for (const head of heads) {
        for (const [query] of left) {
          const row = grid.row(layer, head, query);
          for (let j = 0; j < keys.length; j++) histogram[row[keys[j]]]++;
        }
      }
      this.total = histogram.reduce((a, b) => a + b, 0) - histogram[0];
      this.minByte = hover ? 1 : budgetCutoff(histogram, LINE_BUDGET);
      this.drawn = 0;
      const width = hover ? 2 : 1;
      for (const head of heads) {
        const coords = new Map();
        const pairs = new Map();
        for (const [query, y1] of left) {
          const row = grid.row(layer, head, query);
          for (let j = 0; j < keys.length; j++) {
            const byte = row[keys[j]];
            if (byte < this.minByte) continue;
            if (!coords.has(byte)) { coords.set(byte, []); pairs.set(byte, []); }
            coords.get(byte).push(layout.lineStart, y1, layout.lineEnd, keyY[j]);
            pairs.get(byte).push(query, keys[j]);
          }
        }
        for (const [byte, segments] of coords) {
          this.drawn += segments.length / 4;
          scene.lines(segments, { color: this.lineColor(head), alpha: byte / 255, width },
            { head: layerLevel ? null : head, byte, pairs: pairs.get(byte) });
        }
      }
    }

    /* Learned sinks (gpt-oss) are drawn for per-head weights of a model that has them. */
    sinkShown() {
      return !this.layerLevel() && this.app.sinkMass && this.app.sinkMass(0, 0, 0) !== null;
    }

    /* Under the tokens, the learned sink's share of each visible head's softmax (no value behind it, so the
     * head's weights on the keys sum to 1 minus it): at the focused query, else the mean over the queries shown. */
    drawSink(scene, layout, layer) {
      if (!this.sinkShown()) return;
      const hover = this.focus();
      const queries = hover && hover.side === "query" ? [hover.pos] : layout.left.shown;
      if (!queries.length) return;
      const heads = this.lineHeads();
      const masses = heads.map((head) => [head,
        queries.reduce((sum, query) => sum + this.app.sinkMass(layer, head, query), 0) / queries.length]);
      const where = queries.length === 1 ? `query ${queries[0]} ${JSON.stringify(layout.left.side.tokens[queries[0]])}`
        : "mean over the queries shown";
      const shownMasses = masses.slice(0, 12).map(([head, mass]) => `h${this.headName(head)} ${mass.toFixed(3)}`).join("  ");
      scene.text(8, layout.height - SINK_LINE / 2, `learned sink (no value), ${where}: ${shownMasses}`
        + (masses.length > 12 ? " …" : ""), { size: 11, color: "#2a7a2a" },
      { role: "sink", masses: masses.map(([head, mass]) => ({ head, mass })) });
    }

    /* While hovering: each visible head's weight beside the tokens of the other column (largest first). */
    drawWeights(scene, layout, grid, layer) {
      const app = this.app;
      const hover = this.focus();
      const other = hover.side === "query" ? layout.right : layout.left;
      const x = hover.side === "query" ? layout.rightStart + layout.rightText + 8 : SIDE_SPACE - 8;
      const align = hover.side === "query" ? "left" : "right";
      const heads = this.lineHeads();
      other.shown.forEach((pos, row) => {
        const [query, key] = hover.side === "query" ? [hover.pos, pos] : [pos, hover.pos];
        const weights = heads.map((head) => [head, grid.row(layer, head, query)[key]])
          .filter(([, byte]) => byte > 0).sort((a, b) => b[1] - a[1]);
        if (!weights.length) return;
        const text = weights.slice(0, 3).map(([head, byte]) => app.formatWeight(grid.value(layer, byte)) +
          (heads.length > 1 ? ` h${head}` : "")).join("  ");
        scene.text(x, this.rowY(layout, row), text, { size: Math.min(11, layout.size), align, color: this.lineColor(weights[0][0]) },
          { role: "weight", query, key, heads: this.layerLevel() ? [] : weights.map(([head]) => head) });
      });
    }

    onMove(event) {
      if (!this.layout) return;
      const { x, y } = this.surface.at(event);
      const row = Math.floor((y - TOP) / this.layout.rowHeight);
      let hit = null;
      if (x < this.layout.lineStart && x > SIDE_SPACE - 10 && row >= 0 && row < this.layout.left.shown.length) {
        hit = { side: "query", pos: this.layout.left.shown[row] };
      } else if (x > this.layout.lineEnd && x < this.layout.width - SIDE_SPACE + 10 && row >= 0 && row < this.layout.right.shown.length) {
        hit = { side: "key", pos: this.layout.right.shown[row] };
      }
      this.setHover(hit);
    }

    /* The token whose lines are shown alone: the hovered one, else the selected query token. */
    focus() {
      const selected = this.app.state.selected;
      return this.hover || (Number.isInteger(selected) ? { side: "query", pos: selected } : null);
    }

    setHover(hit) {
      const same = (a, b) => (a === null && b === null) || (a && b && a.side === b.side && a.pos === b.pos);
      if (same(this.hover, hit)) return;
      this.hover = hit;
      this.render();
    }

    /* For tests and tools: every drawn line as {head, q_pos, k_pos, weight} (head null: a layer-level measure). */
    drawnLines() {
      const out = [];
      if (!this.scene) return out;
      const { grid, layer } = this.drawnWith;
      for (const item of this.scene.ofType("lines")) {
        const { head, byte, pairs } = item.meta;
        for (let i = 0; i < pairs.length; i += 2) {
          out.push({ head, q_pos: pairs[i], k_pos: pairs[i + 1], weight: grid.value(layer, byte) });
        }
      }
      return out;
    }

    /* For tests: scroll a token into sight and return its centre in viewport coordinates. */
    tokenPoint(side, pos) {
      const column = side === "query" ? this.layout.left : this.layout.right;
      const row = column.shown.indexOf(pos);
      if (row < 0) return null;
      const wrap = this.surface.wrap;
      const y = this.rowY(this.layout, row);
      if (y < wrap.scrollTop + 20 || y > wrap.scrollTop + wrap.clientHeight - 20) {
        wrap.scrollTop = Math.max(0, y - wrap.clientHeight / 2);
        this.surface.repaint();
      }
      const width = NS.textWidth(NS.label(column.side.tokens[pos], 24), this.layout.size);
      const x = side === "query" ? this.layout.leftEdge - width / 2 : this.layout.rightStart + width / 2;
      return this.surface.point(x, this.rowY(this.layout, row));
    }
  }

  /* The smallest byte such that the lines of at least that byte number at most `budget` (1 if all fit). */
  function budgetCutoff(histogram, budget) {
    let count = 0;
    for (let byte = 255; byte >= 1; byte--) {
      count += histogram[byte];
      if (count > budget) return byte + 1;
    }
    return 1;
  }

  NS.HeadView = HeadView;
})((window.AttnscopeViews = window.AttnscopeViews || {}));
