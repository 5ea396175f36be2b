/* attnscope sentence panel: sentence-level attention (Bogdan et al. 2025, "Thought Anchors") over a text, drawn from
 * a payload's `sentences` (present/sentence_panel.py; steps.schema.json $defs/sentences). Python computes every
 * number; this file decodes and draws them.
 *
 * AttnscopeSentences.attach(view, box) -> Promise of the panel of a step view (steps.js): it follows the view's layer
 *   and head (the mean of all, one layer's mean over its heads, one head), marks a clicked sentence's tokens in the
 *   step text and in the token strip (moving to the step that shows the whole sentence), and a receiver head clicked
 *   becomes the view's layer and head.
 * AttnscopeSentences.render(container, data) -> Promise of a view of its own (the explorer's Sentences tab):
 *   data = {title, tokens, n_layers, n_heads, sentences}; its own layer and head choices and the text.
 * The panel: the sentence x sentence heatmap (query sentences down, key sentences across; the future blank), the
 * sentences with their vertical scores (click one, or a heatmap row), the chosen sentence's row as bars, and the
 * strongest receiver heads. Layers, heads, sentences and positions are 0-indexed. Needs decode.js (AttnscopeViews).
 */
(function (NS, V) {
  "use strict";

  const el = V.element;
  const shown = V.shown;
  const SETS = ["heads", "layers", "all"];
  const HEATMAP_PIXELS = 320;

  /* The panel's packed arrays, unpacked: the three sets of rows and of vertical scores, spans, kurtosis, receivers. */
  async function decodePanel(panel) {
    const rows = await Promise.all(SETS.map((name) => V.unpackRows(panel.attention[name])));
    const vertical = await Promise.all(SETS.map((name) => V.unpackNumbers(panel.vertical[name])));
    const [spans, kurtosis, receivers] = await Promise.all([panel.spans, panel.kurtosis, panel.receivers].map(V.unpackNumbers));
    return { rows: Object.fromEntries(SETS.map((name, i) => [name, rows[i]])),
      vertical: Object.fromEntries(SETS.map((name, i) => [name, vertical[i]])),
      spans, kurtosis, receivers, n: panel.spans.shape[0], nHeads: panel.kurtosis.shape[1] };
  }

  class SentencePanel {
    /* host: {tokens, selection() -> {layer, head}, choose(layer, head), show(start, stop), mark(start, stop)} */
    constructor(box, panel, host) {
      this.box = box;
      this.panel = panel;
      this.host = host;
      this.sentence = null;  // the clicked sentence
      this.drawn = null;  // what the panel shows now (set and sentence): a step change redraws only the marks
    }

    async start() {
      this.d = await decodePanel(this.panel);
      return this;
    }

    /* The set and row index that the host's layer and head choose. */
    which() {
      const { layer, head } = this.host.selection();
      if (layer < 0) return { set: "all", index: 0, label: "mean of all layers and heads" };
      if (head < 0) return { set: "layers", index: layer, label: `layer ${layer}, mean of its heads` };
      return { set: "heads", index: layer * this.d.nHeads + head, label: `layer ${layer}, head ${head}` };
    }

    /* Query sentence i's row [i + 1] (key sentences 0..i), or null where its rows were not kept. */
    row(i) {
      if (i < this.panel.first_query) return null;
      const { set, index } = this.which();
      const rows = this.d.rows[set];
      const start = index * rows.total + (i * (i + 1)) / 2;
      const top = rows.max[index * rows.rows + i];
      return Float32Array.from(rows.bytes.subarray(start, start + i + 1), (b) => (b / rows.levels) * top);
    }

    vertical(i) {
      const { set, index } = this.which();
      return this.d.vertical[set][index * this.d.n + i];
    }

    span(i) { return [this.d.spans[2 * i], this.d.spans[2 * i + 1]]; }

    text(i) {
      const [start, stop] = this.span(i);
      return this.host.tokens.slice(start, stop).join("").trim();
    }

    part(i) {
      const prompt = this.panel.prompt_sentences;
      return prompt === null ? "" : i < prompt ? "prompt" : "generated";
    }

    select(i) {
      this.sentence = i;
      this.host.show(...this.span(i));
    }

    draw() {
      const which = this.which();
      const key = `${which.set}:${which.index}:${this.sentence}`;
      if (key !== this.drawn) {
        this.drawn = key;
        this.drawPanel(which);
      }
      if (this.sentence !== null) this.host.mark(...this.span(this.sentence));
      else this.host.mark(0, 0);
    }

    drawPanel(which) {
      const n = this.d.n;
      const rows = Array.from({ length: n }, (_, i) => this.row(i));
      const note = el("p", "st-note", `${n} sentences${this.panel.prompt_sentences === null ? "" : ` (${this.panel.prompt_sentences} in the prompt)`}: `
        + `attention averaged over each block of query tokens x key tokens (Bogdan et al. 2025), ${which.label}. `
        + `A sentence's vertical score is the mean attention it gets from the sentences at least ${this.panel.proximity} `
        + "later; receiver heads have the most heavy-tailed vertical scores (kurtosis). Click a sentence to mark its tokens.");
      const body = el("div", "sn-body");
      body.append(this.heatmap(rows), this.sentenceList());
      const parts = [el("h4", "st-subtitle", "sentences"), note, body, this.rowBars(rows), ...this.receiverList()];
      if (this.panel.first_query > 0) {
        parts.splice(2, 0, el("p", "st-note", `the rows of sentences 0\u2013${this.panel.first_query - 1} were not kept `
          + "(generate with --prompt-rows all to keep the prompt's): grey in the heatmap; their columns are whole"));
      }
      this.box.replaceChildren(...parts);
      this.box.dataset.set = which.set;
      this.box.dataset.index = String(which.index);
      this.box.dataset.sentence = this.sentence === null ? "" : String(this.sentence);
    }

    /* Query sentences down, key sentences across, shaded by the square root of the share of the largest cell. */
    heatmap(rows) {
      const n = this.d.n;
      const cell = Math.max(1, Math.min(18, Math.floor(HEATMAP_PIXELS / n)));
      const canvas = el("canvas", "sn-heatmap");
      canvas.width = canvas.height = cell * n;
      canvas.dataset.role = "sentence-heatmap";
      const context = canvas.getContext("2d");
      const top = Math.max(1e-12, ...rows.filter((r) => r).map((r) => Math.max(...r)));
      rows.forEach((row, i) => {
        for (let j = 0; j <= i; j++) {
          context.fillStyle = row ? `rgba(200, 70, 30, ${Math.sqrt(row[j] / top).toFixed(3)})` : "#ddd";
          context.fillRect(j * cell, i * cell, cell, cell);
        }
      });
      if (this.sentence !== null) {
        context.strokeStyle = "#23395d";
        context.lineWidth = 2;
        context.strokeRect(1, this.sentence * cell + 1, (this.sentence + 1) * cell - 2, cell - 2);
      }
      const at = (event) => {
        const box = canvas.getBoundingClientRect();
        return [Math.floor((event.clientY - box.top) / cell), Math.floor((event.clientX - box.left) / cell)];
      };
      canvas.addEventListener("mousemove", (event) => {
        const [i, j] = at(event);
        const value = i >= 0 && i < n && j <= i && rows[i] ? rows[i][j].toFixed(4) : null;
        canvas.title = value === null ? "" : `sentence ${i} \u2192 sentence ${j}: ${value}`;
      });
      canvas.addEventListener("click", (event) => {
        const [i] = at(event);
        if (i >= 0 && i < n) this.select(i);
      });
      const holder = el("div", "sn-map");
      holder.append(canvas, el("p", "st-note", `query sentence (down) \u2192 key sentence (across); darkest = ${top.toFixed(4)}`));
      return holder;
    }

    /* Every sentence: its number, part, vertical score as a bar, and its text. */
    sentenceList() {
      const list = el("div", "sn-list");
      list.dataset.role = "sentences";
      const scores = Array.from({ length: this.d.n }, (_, i) => this.vertical(i));
      const top = Math.max(1e-12, ...scores.filter(Number.isFinite));
      scores.forEach((score, i) => {
        const line = el("div", "sn-sentence" + (i === this.sentence ? " st-on" : ""));
        Object.assign(line.dataset, { role: "sentence", sentence: String(i), vertical: Number.isFinite(score) ? score.toFixed(6) : "" });
        const bar = el("span", "st-bar");
        bar.style.width = `${Number.isFinite(score) ? Math.round(60 * score / top) : 0}px`;
        const value = el("span", "sn-value", Number.isFinite(score) ? score.toFixed(4) : "\u2013");
        value.title = Number.isFinite(score) ? "vertical score: mean attention from the sentences far enough below"
          : `no sentence is ${this.panel.proximity} or more below`;
        line.append(el("span", "sn-index", String(i)), el("span", "sn-part", this.part(i)), el("span", "sn-bar", ""), value,
          el("span", "sn-text", shown(this.text(i))));
        line.children[2].append(bar);
        line.addEventListener("click", () => this.select(i));
        list.append(line);
      });
      return list;
    }

    /* The chosen sentence's row: how much of its attention each sentence at or before it gets. */
    rowBars(rows) {
      const box = el("div", "sn-row");
      box.dataset.role = "sentence-row";
      const i = this.sentence;
      if (i === null) {
        box.append(el("p", "st-note", "click a sentence (or a heatmap row) for its row"));
        return box;
      }
      const [start, stop] = this.span(i);
      box.dataset.sentence = String(i);
      const row = rows[i];
      const title = `sentence ${i} (tokens ${start}\u2013${stop - 1}): `;
      if (!row) {
        box.append(el("p", "st-note", title + "its rows were not kept"));
        return box;
      }
      box.append(el("p", "st-note", title + "its mean attention to each sentence at or before it (block means):"));
      const top = Math.max(1e-12, ...row);
      row.forEach((value, j) => {
        const line = el("div", "sn-cell");
        Object.assign(line.dataset, { role: "cell", sentence: String(j), value: value.toFixed(6) });
        const bar = el("span", "st-bar");
        bar.style.width = `${Math.round(80 * value / top)}px`;
        line.append(el("span", "sn-index", String(j)), bar, el("span", "sn-value", value.toFixed(4)),
          el("span", "sn-text", shown(this.text(j)).slice(0, 80)));
        box.append(line);
      });
      return box;
    }

    /* The strongest receiver heads, strongest first; click one to choose it. */
    receiverList() {
      const { receivers, kurtosis, nHeads } = this.d;
      if (!receivers.length) return [el("p", "st-note", "no receiver heads: too few sentences far enough apart")];
      const list = el("div", "sn-receivers");
      list.dataset.role = "receivers";
      for (let r = 0; r < receivers.length / 2; r++) {
        const [layer, head] = [receivers[2 * r], receivers[2 * r + 1]];
        const button = el("button", "sn-receiver", `L${layer} H${head} ${kurtosis[layer * nHeads + head].toFixed(2)}`);
        button.type = "button";
        Object.assign(button.dataset, { role: "receiver", layer: String(layer), head: String(head) });
        button.title = `layer ${layer}, head ${head}: kurtosis of its vertical scores (click to show it)`;
        button.addEventListener("click", () => this.host.choose(layer, head));
        list.append(button);
      }
      return [el("p", "st-note", "receiver heads (kurtosis of the vertical scores, largest first):"), list];
    }
  }

  const mark = (pieces, positionOf, start, stop) => {
    for (const piece of pieces) {
      const position = positionOf(piece);
      piece.classList.toggle("sn-in-sentence", position >= start && position < stop);
    }
  };

  /* The step view as the panel's host. */
  function stepHost(view) {
    const p = view.payload;
    return {
      tokens: p.text,
      selection: () => view.state,
      choose: (layer, head) => view.choose(layer, head),
      /* the sentence's tokens seen: move on to the step whose text reaches its last token (the chosen one), then draw */
      show(start, stop) {
        if (stop - 1 > p.first_step + view.state.step) view.go(stop - 1 - p.first_step);
        else view.draw();
      },
      mark(start, stop) {
        mark(view.attention.querySelectorAll(".st-key[data-key]"), (piece) => Number(piece.dataset.key), start, stop);
        mark(view.attention.querySelectorAll(".st-next"), () => p.first_step + view.state.step, start, stop);
        mark(view.stepCells, (cell) => p.first_step + Number(cell.dataset.step), start, stop);
      },
    };
  }

  NS.attach = async function attach(view, box) {
    return new SentencePanel(box, view.payload.sentences, stepHost(view)).start();
  };

  /* A view of its own: the layer and head choices, the text and the panel. */
  class SentenceView {
    constructor(container, data) {
      this.root = container;
      this.data = data;
      this.state = { layer: -1, head: -1 };
    }

    async start() {
      const d = this.data;
      this.layerBox = el("select");
      this.layerBox.dataset.role = "layer";
      this.layerBox.append(new Option("all layers", "-1"), ...Array.from({ length: d.n_layers }, (_, l) => new Option(`layer ${l}`, String(l))));
      this.headBox = el("select");
      this.headBox.dataset.role = "head";
      this.headBox.append(new Option("mean of heads", "-1"), ...Array.from({ length: d.n_heads }, (_, h) => new Option(`head ${h}`, String(h))));
      this.layerBox.addEventListener("change", () => this.choose(+this.layerBox.value, this.state.head));
      this.headBox.addEventListener("change", () => this.choose(this.state.layer, +this.headBox.value));
      const controls = el("div", "st-controls");
      controls.append("attention of ", this.layerBox, " ", this.headBox);
      this.text = el("div", "st-text");
      this.text.dataset.role = "text";
      d.tokens.forEach((token, k) => {
        const piece = el("span", "st-key", shown(token));
        piece.dataset.key = String(k);
        this.text.append(piece);
        if (token.includes("\n")) this.text.append(el("br"));
      });
      const box = el("div", "st-sentences");
      box.dataset.role = "sentence-panel";
      this.root.replaceChildren(el("h3", "st-title", d.title), controls, this.text, box);
      this.root.classList.add("attnscope-steps");
      this.panel = await new SentencePanel(box, d.sentences, {
        tokens: d.tokens,
        selection: () => this.state,
        choose: (layer, head) => this.choose(layer, head),
        show: () => this.draw(),
        mark: (start, stop) => mark(this.text.children, (piece) => Number(piece.dataset.key ?? -1), start, stop),
      }).start();
      this.draw();
      return this;
    }

    choose(layer, head) {
      this.state = { layer, head: layer < 0 ? -1 : head };
      this.draw();
    }

    draw() {
      this.layerBox.value = String(this.state.layer);
      this.headBox.value = String(this.state.head);
      this.headBox.disabled = this.state.layer < 0;
      this.panel.draw();
      this.root.dataset.drawn = String(Number(this.root.dataset.drawn || 0) + 1);
    }
  }

  NS.render = async function render(container, data) {
    return new SentenceView(container, data).start();
  };
})((window.AttnscopeSentences = window.AttnscopeSentences || {}), window.AttnscopeViews);
