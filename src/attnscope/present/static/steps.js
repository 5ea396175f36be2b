/* attnscope step view: a decoder's output one token at a time, for a causal LM generating
 * (self-attention over the prompt and the text so far) and for an encoder-decoder translating
 * (cross-attention over the source). One page for both: present/steps.py builds the payload
 * (present/steps.schema.json), this file draws it.
 *
 * AttnscopeSteps.render(container, payload, {focus, hash}) -> Promise of the view (also kept in
 * AttnscopeSteps.instances[container.id]). The view shows the generated tokens as a strip (click
 * one, or move with the arrow keys, Home and End), the chosen step's top next tokens with their
 * probabilities, and what its query attended to, drawn over the tokens it saw: one head, one
 * layer's mean over heads, or the mean of all layers and heads, raw or norm-weighted. `focus`: take
 * the keyboard; `hash`: start where the address says (#step=5&layer=2&head=3&norms=1); `onKey(view,
 * key)`: a token of the attention row clicked (the explorer explains that cell with QK attribution).
 * A generation made with --attribute also shows, for the chosen step, the heads that pushed the
 * chosen token's logit up or down most (signed bars, ranked by size; click one to see which tokens
 * it pushed through, shaded over the text) and the logit lens (each layer's top tokens).
 * A generation made with --routes also draws, under the view, the chosen step's information-flow route (routes.js).
 * Attribution and routes arrive packed like the rows, their per-step arrays in blocks of steps. Opening decodes only
 * what the first step draws (the mean rows, the attribution's small arrays, the first block of source terms and
 * routes); a head's or a layer's rows, the norm-weighted ones and another block are decoded when first drawn, once.
 * A click restyles the tokens the step shows (each token's <span> is made once and kept) and draws its route.
 * A generation's sentence panel (sentences.js) follows the chosen layer and head and marks a clicked sentence's tokens.
 * A generation under a KV budget names, in the head menu of the chosen layer, the heads whose KV head streamed.
 * Layers, heads and steps are 0-indexed. Needs decode.js (AttnscopeViews.unpack), routes.js (AttnscopeRoutes) and
 * sentences.js (AttnscopeSentences).
 */
(function (NS, V, R, S) {
  "use strict";

  const el = V.element;  // decode.js
  const shown = V.shown;

  /* One set of rows (payload $defs/rows) as bytes and per-row maxima. */
  async function decodeRows(rows) {
    const values = await V.unpack(rows.values);
    return { bytes: values.bytes, max: await V.unpackNumbers(rows.row_max), total: rows.values.shape.at(-1),
      steps: rows.row_max.shape.at(-1), levels: rows.levels };
  }

  /* The value norms ||v_k W_O^h|| [layer, head, position] the norm-weighted view multiplies a head's row by. */
  async function decodeNorms(weighted) {
    return { norms: await V.unpackNumbers(weighted.value_norms), positions: weighted.value_norms.shape[2] };
  }

  /* The attribution's small arrays (payload $defs/attribution), unpacked at open: logits [step], the ranked heads'
   * (layer, head) [step, rank, 2] and terms [step, rank], and where the generation kept it (--lens) the lens's token
   * indices and probabilities [step, layer, k] (lens null without). The per-source terms come a block of steps at a
   * time (decodeSources). */
  async function decodeAttribution(attribution) {
    const [logits, heads, terms] = await Promise.all([attribution.logits, attribution.heads, attribution.terms]
      .map(V.unpackNumbers));
    const [, ranks] = attribution.terms.shape;
    const decoded = { logits, heads, terms, ranks, lens: null };
    if (attribution.lens) {
      const [lensTokens, lens] = await Promise.all([attribution.lens.tokens, attribution.lens.probs].map(V.unpackNumbers));
      const [, nLayers, k] = attribution.lens.probs.shape;
      Object.assign(decoded, { lensTokens, vocabulary: attribution.lens.vocabulary, lens, nLayers, k });
    }
    return decoded;
  }

  /* One block of source terms (payload $defs/step_blocks): [steps of the block, rank, width] and its width. */
  async function decodeSources(packed) {
    return { values: await V.unpackNumbers(packed), width: packed.shape[2] };
  }

  /* One block of the routes (payload $defs/routes): its edges' codes [edge, 8], importance [edge] and head shares
   * [edge, head], and where each of its steps' run of edges starts (the payload groups them by step, in step order). */
  async function decodeRouteBlock(routes, b) {
    const parts = [routes.edges, routes.importance, routes.heads].map((part) => part.blocks[b]);
    const [codes, importance, heads] = await Promise.all(parts.map(V.unpackNumbers));
    const block = routes.edges.block;
    const starts = new Int32Array(block + 1);
    for (let e = 0; e < parts[0].shape[0]; e++) starts[codes[8 * e] - b * block + 1]++;
    for (let i = 0; i < block; i++) starts[i + 1] += starts[i];
    return { codes, importance, heads, nHeads: parts[2].shape[1], starts };
  }

  /* The edges of the block's `local`-th step as routes.js draws them (Routes.to_dict's edges). */
  function stepEdges(routes, local, kinds, vias) {
    const { codes, importance, heads, nHeads } = routes;
    const edges = [];
    for (let e = routes.starts[local]; e < routes.starts[local + 1]; e++) {
      const c = codes.subarray(8 * e, 8 * e + 8);
      const via = vias[c[7]];
      edges.push({ source: [c[1], c[2], kinds[c[3]]], target: [c[4], c[5], kinds[c[6]]], importance: importance[e], via,
        heads: via === "attention" ? Array.from(heads.subarray(e * nHeads, (e + 1) * nHeads)) : [] });
    }
    return edges;
  }

  /* A signed term as a colour: green pushed the chosen token up, purple pushed it down. */
  const signedShade = (value, max) => {
    const level = max > 0 ? Math.min(1, Math.abs(value) / max) : 0;
    return { colour: value >= 0 ? `rgba(30, 140, 70, ${level.toFixed(3)})` : `rgba(150, 40, 160, ${level.toFixed(3)})`, level };
  };
  const signed = (value, digits) => (value >= 0 ? "+" : "\u2212") + Math.abs(value).toFixed(digits);

  /* A box of the text's tokens, each shaded by its own colour, drawn again at every step: a token's <span> is made the
   * first time it is shown and kept, so a step shows the first n (added or taken off at the end) and restyles only
   * what changed, instead of building every token's label again. A token's hover text is written when the pointer
   * reaches it (describe(k)). `tail`: nodes after the tokens (the arrow and the chosen token). */
  class TokenBox {
    constructor(tokens, { prompt = 0, onKey = null, describe, tail = [] }) {
      Object.assign(this, { tokens, prompt, onKey, describe });
      this.tail = tail.map((node) => (typeof node === "string" ? document.createTextNode(node) : node));
      this.box = el("div", "st-text");
      this.box.append(...this.tail);
      this.pieces = [];  // token k: [its <span>, the <br> after a token with a newline, or null]
      this.colours = [];  // token k's background and text colour as last set
      this.count = 0;  // tokens shown
      this.hovered = null;
      this.box.addEventListener("mouseover", (event) => {
        const piece = event.target.closest ? event.target.closest(".st-key") : null;
        this.hovered = piece && this.box.contains(piece) ? piece : null;
        if (this.hovered) this.hovered.title = this.describe(+this.hovered.dataset.key);
      });
    }

    piece(k) {
      if (!this.pieces[k]) {
        const token = this.tokens[k];
        const span = el("span", k < this.prompt ? "st-key st-prompt" : "st-key", shown(token));
        span.dataset.key = String(k);
        if (this.onKey) span.addEventListener("click", () => this.onKey(k));
        this.pieces[k] = [span, token.includes("\n") ? el("br") : null];
      }
      return this.pieces[k];
    }

    /* Show the first n tokens, token k in colour(k) = [background, white text?]. */
    show(n, colour) {
      if (n > this.count) {
        const more = document.createDocumentFragment();
        for (let k = this.count; k < n; k++) for (const node of this.piece(k)) if (node) more.append(node);
        this.box.insertBefore(more, this.tail[0] || null);
      }
      for (let k = n; k < this.count; k++) for (const node of this.pieces[k]) if (node) node.remove();
      this.count = n;
      for (let k = 0; k < n; k++) {
        const [background, white] = colour(k);
        const span = this.pieces[k][0];
        const was = this.colours[k] || [];
        if (was[0] !== background) span.style.background = background;
        if (was[1] !== white) span.style.color = white ? "white" : "";
        this.colours[k] = [background, white];
      }
      if (this.hovered) this.hovered.title = +this.hovered.dataset.key < n ? this.describe(+this.hovered.dataset.key) : "";
    }
  }

  class StepView {
    constructor(container, payload, options) {
      this.root = container;
      this.payload = payload;
      this.options = options || {};
      this.state = { step: 0, layer: -1, head: -1, weighted: false, brighten: false, rank: 0 };
      this.offsets = [0];
      for (const n of payload.keys) this.offsets.push(this.offsets.at(-1) + n);
      this.decoded = { attribution: null };
      this.parts = new Map();  // a decoded part's name -> the Promise of it (decodePart)
      this.ready = new Map();  // a decoded part's name -> it, once decoded: what draw() reads
      this.asked = 0;  // the number of the latest show(); an earlier one whose parts arrive late does not draw
      this.pending = Promise.resolve();
      this.drawCount = 0;
    }

    async start() {
      // learned sinks (gpt-oss): [layer, head, step], each step's share of the softmax on the sink logit
      this.sinkMass = this.payload.sink_mass ? await V.unpackNumbers(this.payload.sink_mass) : null;
      if (this.payload.attribution) this.decoded.attribution = await decodeAttribution(this.payload.attribution);
      this.build();
      if (this.payload.sentences) this.sentences = await S.attach(this, this.sentenceBox);
      if (this.options.hash) this.fromAddress();
      await this.show();
      // the time from navigation to the first step drawn, for the page benchmarks (benchmarks/steps_page.py)
      if (this.root.id) performance.mark(`attnscope:${this.root.id}:drawn`);
      if (this.options.focus) this.root.focus();
      return this;
    }

    get nSteps() { return this.payload.steps.length; }

    // ---- decoding on demand --------------------------------------------------------------
    /* The parts the current state draws: its row set ("attention.all|layers|heads", "weighted.all|layers", the value
     * norms "weighted.norms"), and the step's block of source terms ("sources.B") and of routes ("routes.B"). */
    neededParts() {
      const { layer, head, weighted, step } = this.state;
      const p = this.payload;
      const which = layer < 0 ? "all" : head < 0 ? "layers" : "heads";
      const parts = !weighted ? [`attention.${which}`]
        : which === "heads" ? ["attention.heads", "weighted.norms"] : [`weighted.${which}`];
      if (p.attribution) parts.push(`sources.${Math.floor(step / p.attribution.sources.block)}`);
      if (p.routes) parts.push(`routes.${Math.floor(step / p.routes.edges.block)}`);
      return parts;
    }

    /* The Promise of a decoded part (decoded once, the first time it is asked for; then kept in this.ready). */
    decodePart(name) {
      if (!this.parts.has(name)) {
        const [group, which] = name.split(".");
        const p = this.payload;
        const decoding = group === "sources" ? decodeSources(p.attribution.sources.blocks[+which])
          : group === "routes" ? decodeRouteBlock(p.routes, +which)
            : which === "norms" ? decodeNorms(p.weighted) : decodeRows(p[group][which]);
        this.parts.set(name, decoding.then((part) => { this.ready.set(name, part); return part; }));
      }
      return this.parts.get(name);
    }

    /* Draw the current state: at once when its parts are decoded, else once they are (unless another show() was asked
     * for meanwhile: the latest draws). Returns a Promise that settles when this one is done. */
    show() {
      const asked = ++this.asked;
      const parts = this.neededParts();
      if (parts.every((name) => this.ready.has(name))) {
        this.draw();
        this.pending = Promise.resolve();
      } else {
        this.pending = Promise.all(parts.map((name) => this.decodePart(name))).then(() => {
          if (asked === this.asked) this.draw();
        });
      }
      return this.pending;
    }

    /* Settles once the latest state asked for is drawn (for tests and tools reading the view). */
    async settled() {
      let waited;
      do {
        waited = this.pending;
        await waited;
      } while (waited !== this.pending);
    }

    /* The current step's row as weights [keys] and its largest weight: one head, one layer's mean
     * over heads, or the mean of all. A norm-weighted head row is its attention row times each
     * key's value norm (the payload ships the norms, not a second copy of every head's rows). */
    currentRow() {
      const { layer, head, weighted, step } = this.state;
      const n = this.payload.keys[step];
      const rows = this.ready.get(this.neededParts()[0]);  // the row set: each head's, each layer's mean, or all's
      const index = layer < 0 ? 0 : head < 0 ? layer : layer * this.payload.n_heads + head;
      const start = index * rows.total + this.offsets[step];
      const top = rows.max[index * rows.steps + step];
      const weights = Float32Array.from(rows.bytes.subarray(start, start + n), (b) => (b / rows.levels) * top);
      if (!weighted || layer < 0 || head < 0) return { weights, max: top };
      const { norms, positions } = this.ready.get("weighted.norms");
      const base = index * positions;
      let max = 0;
      for (let k = 0; k < n; k++) {
        weights[k] *= norms[base + k];
        max = Math.max(max, weights[k]);
      }
      return { weights, max };
    }

    /* The learned sink mass of the current row (the head's, or the mean over the heads or over everything
     * shown), or null for a model without learned sinks. Its row over the tokens sums to 1 minus it. */
    currentSinkMass() {
      if (!this.sinkMass) return null;
      const { layer, head, step } = this.state;
      const { n_layers: nLayers, n_heads: nHeads } = this.payload;
      const nSteps = this.nSteps;
      let total = 0, count = 0;
      for (let l = 0; l < nLayers; l++) {
        if (layer >= 0 && l !== layer) continue;
        for (let h = 0; h < nHeads; h++) {
          if (head >= 0 && h !== head) continue;
          total += this.sinkMass[(l * nHeads + h) * nSteps + step];
          count++;
        }
      }
      return total / count;
    }

    /* The line under the tokens that shows the learned sink's share as a bar of its own. */
    sinkLine(mass) {
      const line = el("p", "st-sink");
      line.dataset.role = "sink";
      line.dataset.mass = mass.toFixed(6);
      const bar = el("span", "st-bar");
      bar.style.width = `${Math.round(80 * mass)}px`;
      line.title = "gpt-oss style learned sink: one more logit in the softmax with no value behind it";
      line.append(bar, ` learned sink (no value): ${mass.toFixed(3)} of the softmax; the weights on the tokens `
        + `sum to ${(1 - mass).toFixed(3)}`);
      return line;
    }

    /* The current row's weights as numbers [keys], once drawn (a Promise; for tests and tools). */
    async row() {
      await this.settled();
      return Array.from(this.currentRow().weights);
    }

    /* The current step's ranked heads as [layer, head, signed term], largest |term| first (attribution only). */
    rankedHeads() {
      const d = this.decoded.attribution;
      const step = this.state.step;
      return Array.from({ length: d.ranks }, (_, r) => {
        const at = step * d.ranks + r;
        return [d.heads[2 * at], d.heads[2 * at + 1], d.terms[at]];
      });
    }

    /* The current step's logit lens tokens [layer][k], best first (a generation with the lens only). */
    lensTokens() {
      const d = this.decoded.attribution;
      const base = this.state.step * d.nLayers * d.k;
      return Array.from({ length: d.nLayers }, (_, l) => Array.from({ length: d.k },
        (_, r) => d.vocabulary[d.lensTokens[base + l * d.k + r]]));
    }

    /* The selected head's term of the current step split over the tokens it read [keys] (attribution only; its
     * block decoded). A term under 1/2048 of the largest arrives as 0 (it is drawn unshaded either way). */
    stepSources() {
      const { step, rank } = this.state;
      const block = this.payload.attribution.sources.block;
      const { values, width } = this.ready.get(`sources.${Math.floor(step / block)}`);
      const start = ((step % block) * this.decoded.attribution.ranks + rank) * width;
      const terms = new Float32Array(this.payload.keys[step]);
      terms.set(values.subarray(start, start + Math.min(width, terms.length)));
      return terms;
    }

    /* The same as numbers, once drawn (a Promise; for tests and tools). */
    async sourceTerms() {
      await this.settled();
      return Array.from(this.stepSources());
    }

    // ---- controls ------------------------------------------------------------------------
    build() {
      const p = this.payload;
      const meta = el("p", "st-meta", [p.model, p.method, `${this.nSteps} steps`].filter(Boolean).join(" \u00b7 "));
      if (p.changes) {
        const badge = el("span", "st-changes", `interventions: ${p.changes}`);
        badge.dataset.role = "changes";
        meta.append(" ", badge);
      }
      const controls = el("div", "st-controls");
      this.prev = el("button", "", "\u25c0 previous");
      this.next = el("button", "", "next \u25b6");
      for (const b of [this.prev, this.next]) b.type = "button";
      this.prev.addEventListener("click", () => this.go(this.state.step - 1));
      this.next.addEventListener("click", () => this.go(this.state.step + 1));
      this.position = el("span", "st-position");
      this.layerBox = el("select");
      this.layerBox.dataset.role = "layer";
      this.layerBox.append(new Option("all layers", "-1"));
      for (let l = 0; l < p.n_layers; l++) this.layerBox.append(new Option(`layer ${l}`, String(l)));
      this.headBox = el("select");
      this.headBox.dataset.role = "head";
      this.headBox.append(new Option("mean of heads", "-1"));
      for (let h = 0; h < p.n_heads; h++) this.headBox.append(new Option(`head ${h}`, String(h)));
      this.layerBox.addEventListener("change", () => this.choose(+this.layerBox.value, this.state.head));
      this.headBox.addEventListener("change", () => this.choose(this.state.layer, +this.headBox.value));
      const attention = el("label", "st-field", `${p.kind === "cross" ? "cross-attention" : "attention"} of `);
      attention.append(this.layerBox, " ", this.headBox);
      controls.append(this.prev, this.next, this.position, attention);
      if (p.weighted) {
        this.normsBox = el("input");
        this.normsBox.type = "checkbox";
        this.normsBox.dataset.role = "norms";
        this.normsBox.addEventListener("change", () => this.setWeighted(this.normsBox.checked));
        const label = el("label", "st-field");
        label.title = "\u2016\u03b1 f(x)\u2016 of Kobayashi et al. 2020: each weight times the norm of what its key's value adds";
        label.append(this.normsBox, " norm-weighted");
        controls.append(label);
      }
      this.brightBox = el("input");
      this.brightBox.type = "checkbox";
      this.brightBox.addEventListener("change", () => { this.state.brighten = this.brightBox.checked; this.show(); });
      const bright = el("label", "st-field");
      bright.title = "shade by the square root of the weight, so that small weights show";
      bright.append(this.brightBox, " brighten");
      controls.append(bright);

      this.strip = el("div", "st-strip");
      this.strip.dataset.role = "strip";
      this.stepCells = p.steps.map((step, i) => {
        const cell = el("span", "st-step", shown(step.chosen));
        cell.dataset.step = String(i);
        cell.title = `step ${i}`;
        cell.addEventListener("click", () => this.go(i));
        this.strip.append(cell);
        if (step.chosen.includes("\n")) this.strip.append(el("br"));
        return cell;
      });
      this.candidates = el("div", "st-cands");
      this.candidates.dataset.role = "candidates";
      this.attention = this.buildAttention();
      this.caption = el("p", "st-note");
      const body = el("div", "st-body");
      body.append(this.candidates, this.attention);
      this.attribution = p.attribution ? this.buildAttribution() : null;
      this.route = el("div", "st-route");
      this.route.dataset.role = "route";
      this.sentenceBox = el("div", "st-sentences");
      this.sentenceBox.dataset.role = "sentence-panel";
      const parts = [el("h3", "st-title", p.title), meta, ...p.notes.map((n) => el("p", "st-note", n)), controls,
        el("p", "st-note", p.kind === "cross" ? "the decoded tokens (click one, or use \u2190 \u2192):"
          : "the generated tokens (click one, or use \u2190 \u2192):"), this.strip, body, this.caption,
        ...(p.attribution ? [this.attribution] : []), ...(p.routes ? [this.route] : []),
        ...(p.sentences ? [this.sentenceBox] : [])];
      this.root.replaceChildren(...parts);
      this.root.classList.add("attnscope-steps", `st-${p.kind}`);
      if (!this.root.hasAttribute("tabindex")) this.root.tabIndex = 0;  // takes the arrow keys once focused
      // a container drawn again (the explorer's next generation) answers the keys for the new view only
      if (this.root.attnscopeStepsKeys) this.root.removeEventListener("keydown", this.root.attnscopeStepsKeys);
      this.root.attnscopeStepsKeys = (event) => this.key(event);
      this.root.addEventListener("keydown", this.root.attnscopeStepsKeys);
    }

    /* The attention panel, drawn again at every step: a note, the tokens shaded by the row (kept: TokenBox), for an
     * encoder-decoder the text so far, and the learned sink's line. */
    buildAttention() {
      const p = this.payload;
      const panel = el("div", "st-attn");
      panel.dataset.role = "attention";
      this.attentionNote = el("p", "st-note");
      this.attentionNext = el("span", "st-next");
      this.attentionNext.title = "the token this step chose";
      const describe = (k) => `key ${k} ${JSON.stringify(this.keyTokens[k])}: ${this.shownRow.weights[k].toFixed(4)}`;
      const onKey = this.options.onKey ? (k) => this.options.onKey(this, k) : null;
      this.keyTokens = p.kind === "cross" ? p.source : p.text;
      this.keyBox = new TokenBox(this.keyTokens, { prompt: p.kind === "cross" ? 0 : p.first_step, onKey, describe,
        tail: p.kind === "cross" ? [] : [" \u2192 ", this.attentionNext] });
      this.sinkSlot = el("div");
      panel.append(this.attentionNote, this.keyBox.box);
      if (p.kind === "cross") {
        this.prefix = el("div", "st-text");
        panel.append(el("p", "st-note", "the text so far and the chosen token:"), this.prefix);
      }
      panel.append(this.sinkSlot);
      return panel;
    }

    /* The attribution panel: a title, the ranked heads' bars, the chosen head's terms over the tokens (kept:
     * TokenBox) and the logit lens. */
    buildAttribution() {
      const p = this.payload;
      const panel = el("div", "st-attrib");
      panel.dataset.role = "attribution";
      this.attributionTitle = el("p", "st-note");
      this.headBars = el("div", "st-heads");
      this.headBars.dataset.role = "heads";
      this.sourcesNote = el("p", "st-note");
      this.sourcesNext = el("span", "st-next");
      const describe = (k) => {
        const term = this.shownSources.terms[k];
        return `key ${k} ${JSON.stringify(p.text[k])}: ` + (term === 0 && this.shownSources.top > 0
          ? "under 1/2048 of the largest share (shipped as 0)" : signed(term, 4));
      };
      this.sourceBox = new TokenBox(p.text, { describe, tail: [" \u2192 ", this.sourcesNext] });
      this.sourceBox.box.dataset.role = "sources";
      this.lensBox = el("div");
      const body = el("div", "st-attrib-body");
      const left = el("div");
      left.append(this.headBars);
      const right = el("div");
      right.append(this.sourcesNote, this.sourceBox.box);
      body.append(left, right);
      panel.append(el("h4", "st-subtitle", "attribution"), this.attributionTitle, body, this.lensBox);
      return panel;
    }

    /* A page of its own starts where its address says: steps.html#step=5&layer=2&head=3&norms=1 (0-indexed). */
    fromAddress() {
      const asked = new URLSearchParams(window.location.hash.replace(/^#/, ""));
      const number = (name, low, high) => {
        const value = Number(asked.get(name));
        return asked.has(name) && Number.isInteger(value) && value >= low && value <= high ? value : null;
      };
      this.state.step = number("step", 0, this.nSteps - 1) ?? 0;
      const layer = number("layer", 0, this.payload.n_layers - 1);
      if (layer !== null) Object.assign(this.state, { layer, head: number("head", 0, this.payload.n_heads - 1) ?? -1 });
      this.state.weighted = asked.get("norms") === "1" && !!this.payload.weighted;
    }

    key(event) {
      if (event.target.matches && event.target.matches("select, input, textarea")) return;
      const moves = { ArrowRight: this.state.step + 1, ArrowLeft: this.state.step - 1, Home: 0, End: this.nSteps - 1 };
      if (!(event.key in moves)) return;
      event.preventDefault();
      this.go(moves[event.key]);
    }

    go(step) {
      const next = Math.max(0, Math.min(this.nSteps - 1, step));
      if (next !== this.state.step) this.state.rank = 0;  // another step has other heads: start at its strongest
      this.state.step = next;
      return this.show();
    }

    /* Show what the step's head of this rank (0 = the largest |term|) pushed through each token. */
    pickHead(rank) {
      this.state.rank = rank;
      this.show();
      this.root.focus({ preventScroll: true });  // the clicked bar is drawn anew: keep the arrow keys on the view
    }

    choose(layer, head) {
      this.state.layer = layer;
      this.state.head = layer < 0 ? -1 : head;
      return this.show();
    }

    setWeighted(on) {
      this.state.weighted = on && !!this.payload.weighted;
      return this.show();
    }

    /* Under a KV budget (payload.streamed_heads), name the chosen layer's heads whose KV head streamed. */
    markStreamed(layer) {
      const streamed = this.payload.streamed_heads;
      if (!streamed) return;
      const here = new Set(streamed.filter(([l]) => l === layer).map(([, h]) => h));
      for (const option of this.headBox.options) {
        const head = Number(option.value);
        if (head < 0) continue;
        option.textContent = here.has(head) ? `head ${head} (streamed)` : `head ${head}`;
        option.dataset.streamed = String(here.has(head));
      }
    }

    // ---- drawing -------------------------------------------------------------------------
    /* Draw the current state (its parts decoded: show() sees to it). */
    draw() {
      const p = this.payload;
      const s = this.state;
      this.layerBox.value = String(s.layer);
      this.markStreamed(s.layer);
      this.headBox.value = String(s.head);
      this.headBox.disabled = s.layer < 0;
      if (this.normsBox) this.normsBox.checked = s.weighted;
      this.prev.disabled = s.step === 0;
      this.next.disabled = s.step === this.nSteps - 1;
      this.position.textContent = `step ${s.step} of 0\u2013${this.nSteps - 1}`;
      if (this.onCell !== undefined) this.stepCells[this.onCell].classList.remove("st-on");
      this.stepCells[s.step].classList.add("st-on");
      this.onCell = s.step;
      this.drawCandidates(p.steps[s.step]);
      this.drawAttention();
      if (p.attribution) this.drawAttribution();
      if (p.routes) this.drawRoute();
      if (this.sentences) this.sentences.draw();
      // after every part is drawn, so that the page is laid out once, not once per part: show the newest tokens,
      // and the step's cell in the strip
      for (const box of this.attention.querySelectorAll(".st-text")) box.scrollTop = box.scrollHeight;
      this.stepCells[s.step].scrollIntoView({ block: "nearest" });
      this.root.dataset.step = String(s.step);
      this.root.dataset.drawn = String(++this.drawCount);
    }

    drawCandidates(step) {
      const head = el("p", "st-chosen-line");
      const chosen = el("b", "st-chosen", shown(step.chosen));
      chosen.dataset.role = "chosen";
      head.append(`step ${this.state.step} chose `, chosen,
        step.probability === null ? "" : ` (probability ${step.probability.toFixed(3)})`);
      const list = el("div", "st-cand-list");
      for (const c of step.candidates) {
        const line = el("div", "st-cand" + (c.token === step.chosen ? " st-chosen" : ""));
        const bar = el("span", "st-bar");
        bar.style.width = `${Math.round(80 * c.probability)}px`;
        const logit = c.logit === undefined ? "" : ` (logit ${c.logit.toFixed(1)})`;
        line.append(bar, el("span", "st-token", JSON.stringify(c.token)), el("span", "", ` ${c.probability.toFixed(3)}${logit}`));
        list.append(line);
      }
      const parts = [head, el("p", "st-note", "top next tokens (probability):"), list];
      if (step.beams) {
        parts.push(el("p", "st-note", "live beams (log-probability):"));
        for (const [text, score] of step.beams) parts.push(el("div", "st-beam", `${score.toFixed(2)}  ${text}`));
      }
      this.candidates.replaceChildren(...parts);
    }

    /* The keys shaded by the current row: darkest = the row's largest weight. */
    drawAttention() {
      const p = this.payload;
      const s = this.state;
      const row = this.shownRow = this.currentRow();
      const chosen = shown(p.text[p.first_step + s.step]);
      const which = s.layer < 0 ? "mean of all layers and heads" : s.head < 0 ? `layer ${s.layer}, mean of its heads`
        : `layer ${s.layer}, head ${s.head}`;
      const what = s.weighted ? "norm-weighted attention \u2016\u03b1 f(x)\u2016" : "attention";
      const shade = (k) => {
        const level = row.max > 0 ? row.weights[k] / row.max : 0;
        const value = s.brighten ? Math.sqrt(level) : level;
        return [`rgba(200, 70, 30, ${value.toFixed(3)})`, value > 0.55];
      };
      if (p.kind === "cross") {
        this.attentionNote.textContent = `${what} of the newest decoder token over the source (${which}):`;
        this.keyBox.show(p.source.length, shade);
        const next = el("span", "st-next", chosen);
        next.title = "the token this step chose";
        this.prefix.replaceChildren(p.text.slice(0, p.first_step + s.step).map(shown).join(" "), " \u2192 ", next);
      } else {
        this.attentionNote.textContent = `${what} of the last token so far over the prompt and the text so far `
          + `(${which}); then the chosen token:`;
        this.attentionNext.textContent = chosen;
        this.keyBox.show(p.first_step + s.step, shade);
      }
      const sink = this.currentSinkMass();
      this.sinkSlot.replaceChildren(...(sink !== null && !s.weighted ? [this.sinkLine(sink)] : []));
      this.caption.textContent = `darkest = this row's largest weight (${row.max.toFixed(4)}); hover a token for its weight. `
        + (p.kind === "self" ? "Prompt tokens are underlined. " : "") + "Layers, heads and steps are 0-indexed.";
    }
  }

  Object.assign(StepView.prototype, {
    /* The step's ranked heads (signed bars), the selected head's terms over the tokens, the logit lens. */
    drawAttribution() {
      const p = this.payload;
      const { step, rank } = this.state;
      const heads = this.rankedHeads();
      const largest = Math.max(...heads.map((h) => Math.abs(h[2])), 1e-9);
      const chosen = JSON.stringify(p.steps[step].chosen);
      this.attributionTitle.textContent = `what the heads did to the logit of ${chosen} `
        + `(${this.decoded.attribution.logits[step].toFixed(2)}, the sum of every head, MLP, embedding and bias term): `
        + "the heads that pushed it most, up (green) or down (purple); click one to see which tokens it pushed through";
      this.headBars.replaceChildren(...heads.map(([layer, head, term], r) => {
        const line = el("button", "st-head" + (r === rank ? " st-on" : ""));
        line.type = "button";
        Object.assign(line.dataset, { role: "head-bar", rank: String(r), layer: String(layer), head: String(head) });
        const bar = el("span", "st-sbar " + (term >= 0 ? "st-up" : "st-down"));
        bar.style.width = `${Math.round(90 * Math.abs(term) / largest)}px`;
        const half = (filled, side) => { const box = el("span", `st-half ${side}`); if (filled) box.append(bar); return box; };
        line.append(el("span", "st-head-name", `L${layer} H${head}`), half(term < 0, "st-neg"), half(term >= 0, "st-pos"),
          el("span", "st-term", signed(term, 3)));
        line.addEventListener("click", () => this.pickHead(r));
        return line;
      }));
      const [layer, head, term] = heads[rank];
      const terms = this.stepSources();
      let top = 1e-9;
      for (const value of terms) top = Math.max(top, Math.abs(value));
      this.shownSources = { terms, top };
      Object.assign(this.sourceBox.box.dataset, { layer: String(layer), head: String(head) });
      this.sourcesNext.textContent = shown(p.text[p.first_step + step]);
      this.sourceBox.show(terms.length, (k) => {
        const { colour, level } = signedShade(terms[k], top);
        return [colour, level > 0.55];
      });
      this.sourcesNote.textContent = `layer ${layer}, head ${head} added ${signed(term, 3)} to the logit of ${chosen}; `
        + "its share through each token it read (attention weight \u00d7 what that token's value adds), darkest = "
        + `${top.toFixed(3)}; hover a token for its share`;
      this.lensBox.replaceChildren(...(this.decoded.attribution.lens ? this.lensStrip() : []));
    },

    /* The step's route (--routes): the prediction at the position before the chosen token, its kept edges. */
    drawRoute() {
      const p = this.payload;
      const step = this.state.step;
      const block = p.routes.edges.block;
      const edges = stepEdges(this.ready.get(`routes.${Math.floor(step / block)}`), step % block, p.routes.node_kinds,
        p.routes.vias);
      const holder = el("div");
      R.draw(holder, { tokens: p.text, position: p.first_step - 1 + step, predicted: p.steps[step].chosen,
        n_layers: p.n_layers, n_heads: p.n_heads, edges });
      this.route.replaceChildren(el("h4", "st-subtitle", "route"), holder);
      this.route.dataset.step = String(step);
      this.route.dataset.edges = holder.dataset.edges;
    },

    /* The logit lens of the step: one column per layer, its top tokens shaded by probability. */
    lensStrip() {
      const p = this.payload;
      const d = this.decoded.attribution;
      const step = this.state.step;
      const tokens = this.lensTokens();
      const table = el("table", "st-lens");
      table.dataset.role = "lens";
      const header = el("tr");
      header.append(el("th", "", "layer"), ...tokens.map((_, l) => el("th", "", String(l))));
      table.append(header);
      for (let r = 0; r < d.k; r++) {
        const row = el("tr");
        row.append(el("th", "", r === 0 ? "top" : `#${r + 1}`));
        tokens.forEach((layerTokens, l) => {
          const probability = d.lens[(step * d.nLayers + l) * d.k + r];
          const cell = el("td", layerTokens[r] === p.steps[step].chosen ? "st-lens-chosen" : "", shown(layerTokens[r]));
          cell.style.background = `rgba(74, 123, 208, ${Math.min(1, probability).toFixed(3)})`;
          if (probability > 0.55) cell.style.color = "white";
          cell.title = `layer ${l}: ${JSON.stringify(layerTokens[r])} ${probability.toFixed(3)}`;
          row.append(cell);
        });
        table.append(row);
      }
      const box = el("div", "st-lens-box");
      box.append(table);
      return [el("p", "st-note", "logit lens: each layer's residual stream read through the final norm and the LM "
        + "head; its top tokens, shaded by probability (the chosen token boxed; the last layer is the model's own):"), box];
    },
  });

  NS.instances = NS.instances || {};
  NS.render = async function render(container, payload, options) {
    const view = await new StepView(container, payload, options).start();
    if (container.id) NS.instances[container.id] = view;
    return view;
  };
})((window.AttnscopeSteps = window.AttnscopeSteps || {}), window.AttnscopeViews, window.AttnscopeRoutes,
  window.AttnscopeSentences);
