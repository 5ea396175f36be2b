/* attnscope route drawing: one information-flow route (attnscope.routes; Ferrando & Voita 2024) as an SVG,
 * shared by the step view (steps.js: a generation made with --routes) and the explorer's Routes tab.
 *
 * AttnscopeRoutes.draw(container, graph) -> the <svg>; it replaces the container's children. `graph` has the shape
 * of Routes.to_dict() (Python):
 *   { tokens: string[], position: int, predicted: string, tau?: number, n_layers: int, n_heads: int,
 *     edges: [{ source: [layer, position, kind], target: [layer, position, kind], // kind: residual | attention | ffn
 *               importance: number, via: "attention" | "residual" | "ffn",
 *               heads: number[] }] }  // [head]: an attention edge's per-head shares (sum = importance); else []
 * Tokens 0..position on x, layers on y (layer 0 at the bottom, "out" on top): each layer's residual stream, its
 * attention block's output a third of a layer up, its feed-forward block two thirds up and shifted right (as
 * Routes.plot places them). Edge width = importance; an attention edge is coloured by its top head, which its
 * hover text (an SVG <title>) names with its share. Drawn edges carry data-role="edge". Up to LABEL_ALL positions every
 * token is labelled under its column; past that only those the route passes through and the predicting one (with
 * their positions), so a route late in a long text draws its few dozen nodes' labels, not a thousand. Layers, heads and
 * positions are 0-indexed.
 */
(function (NS) {
  "use strict";

  // the SVG namespace, read from an <svg> the HTML parser made (a page here holds no URL, not even this one)
  const SVG = (() => {
    const holder = document.createElement("div");
    holder.innerHTML = "<svg></svg>";
    return holder.firstChild.namespaceURI;
  })();
  const LEVEL = { residual: 0, attention: 1 / 3, ffn: 2 / 3 };  // height of each node kind within its layer
  const FFN_SHIFT = 0.3;  // the feed-forward node sits beside its position's column
  const ROW = 26, LEFT = 40, TOP = 12, BOTTOM = 90, RIGHT = 60;  // pixels (the right: the last token's slanted label)
  const COLUMNS = [30, 64, 900];  // a token's column: 30 to 64 pixels, wider when few tokens share 900
  const WIDTH = 8;  // stroke width of an edge of importance 1 (plus 0.6)
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf"];
  const VIA_COLOUR = { residual: "#9a9a9a", ffn: "#c77c1e" };
  const LABEL_ALL = 80;  // positions up to which every token is labelled (a sentence or two reads along the axis)

  const svg = (tag, attributes, text) => {
    const e = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attributes || {})) e.setAttribute(name, String(value));
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const html = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const shown = (token) => JSON.stringify(token);

  /* The largest share of an attention edge's heads: [head, share], or null off attention edges. */
  function topHead(heads) {
    if (!heads || heads.length === 0) return null;
    let best = 0;
    heads.forEach((share, h) => { if (share > heads[best]) best = h; });
    return [best, heads[best]];
  }

  function layout(graph) {
    const nLayers = graph.n_layers;
    const [narrow, wide, total] = COLUMNS;
    const column = Math.max(narrow, Math.min(wide, total / (graph.position + 1)));
    const x = (position, kind) => LEFT + (position + (kind === "ffn" ? FFN_SHIFT : 0) + 0.5) * column;
    const y = (layer, kind) => TOP + (nLayers - layer - LEVEL[kind]) * ROW;
    return { x, y, width: LEFT + (graph.position + 1) * column + RIGHT, height: TOP + nLayers * ROW + BOTTOM };
  }

  function edgeTitle(graph, edge) {
    const [sl, sp, sk] = edge.source;
    const [tl, tp, tk] = edge.target;
    const where = (layer, position, kind) => `${kind} L${layer} @${position} ${shown(graph.tokens[position])}`;
    const top = topHead(edge.heads);
    const head = top ? `; top head ${top[0]} (${top[1].toFixed(3)} of it)` : "";
    return `${edge.via} edge ${where(sl, sp, sk)} \u2192 ${where(tl, tp, tk)}: importance ${edge.importance.toFixed(3)}${head}`;
  }

  /* The positions labelled under the axis: all of them in a short text, else those the route's edges touch and the
   * predicting one (null: all). */
  function labelled(graph) {
    if (graph.position < LABEL_ALL) return null;
    const positions = new Set([graph.position]);
    for (const edge of graph.edges) positions.add(edge.source[1]).add(edge.target[1]);
    return [...positions].sort((a, b) => a - b);
  }

  function axes(graph, place) {
    const group = svg("g", { class: "rt-axes", "font-size": 10, fill: "#555" });
    for (let layer = 0; layer <= graph.n_layers; layer++) {
      const y = place.y(layer, "residual");
      group.append(svg("line", { x1: LEFT - 4, x2: place.width - RIGHT, y1: y, y2: y, stroke: "#eee" }),
        svg("text", { x: LEFT - 6, y: y + 3, "text-anchor": "end" }, layer === graph.n_layers ? "out" : String(layer)));
    }
    const base = place.y(0, "residual") + 8;
    const some = labelled(graph);
    for (const position of some || graph.tokens.slice(0, graph.position + 1).keys()) {
      const x = place.x(position, "residual");
      const text = (some ? `${position} ` : "") + shown(graph.tokens[position]);
      const label = svg("text", { x, y: base, transform: `rotate(60 ${x} ${base})`, "font-family": "monospace",
        class: position === graph.position ? "rt-token rt-predicting" : "rt-token" }, text);
      label.append(svg("title", {}, `position ${position} ${shown(graph.tokens[position])}`));
      group.append(label);
    }
    return group;
  }

  /* Draw `graph` into `container` (see the file's comment); returns the <svg>. */
  NS.draw = function draw(container, graph) {
    const place = layout(graph);
    const picture = svg("svg", { width: place.width, height: place.height, class: "rt-svg", role: "img",
      "aria-label": `route of position ${graph.position}` });
    picture.append(axes(graph, place));
    const lines = svg("g", { class: "rt-edges", "stroke-linecap": "round" });
    const nodes = new Map([[`${graph.n_layers},${graph.position},residual`, [graph.n_layers, graph.position, "residual"]]]);
    for (const edge of graph.edges) {
      const [sl, sp, sk] = edge.source;
      const [tl, tp, tk] = edge.target;
      const top = topHead(edge.heads);
      const colour = top ? PALETTE[top[0] % PALETTE.length] : VIA_COLOUR[edge.via];
      const line = svg("line", { x1: place.x(sp, sk), y1: place.y(sl, sk), x2: place.x(tp, tk), y2: place.y(tl, tk),
        stroke: colour, "stroke-width": (0.6 + WIDTH * edge.importance).toFixed(2), "stroke-opacity": 0.75,
        "data-role": "edge", "data-via": edge.via, "data-importance": edge.importance });
      if (top) line.setAttribute("data-head", String(top[0]));
      line.append(svg("title", {}, edgeTitle(graph, edge)));
      lines.append(line);
      for (const node of [edge.source, edge.target]) nodes.set(node.join(","), node);
    }
    const dots = svg("g", { class: "rt-nodes", fill: "#222" });
    for (const [layer, position, kind] of nodes.values()) {
      dots.append(svg("circle", { cx: place.x(position, kind), cy: place.y(layer, kind), r: 2.2 }));
    }
    picture.append(lines, dots);
    const tau = graph.tau === undefined || graph.tau === null ? "" : ` above tau = ${graph.tau}`;
    const caption = html("p", "rt-caption", `route of position ${graph.position} ${shown(graph.tokens[graph.position])} `
      + `\u2192 ${shown(graph.predicted)}: ${graph.edges.length} edges${tau}`
      + (graph.edges.length ? "" : " (nothing reaches the prediction above the threshold)")
      + (labelled(graph) ? `. Of the ${graph.position + 1} tokens, those the route passes through are labelled (with `
        + "their positions)" : "") + ". Tokens across, layers up (0-indexed; each layer's residual stream, its attention output a third up, its "
      + "feed-forward block two thirds up and to the right); width = importance; attention edges coloured by their top "
      + "head, residual edges grey, feed-forward edges orange. Hover an edge for its importance and top head.");
    const scroll = html("div", "rt-scroll");
    scroll.append(picture);
    container.classList.add("attnscope-route");
    container.replaceChildren(caption, scroll);
    container.dataset.edges = String(graph.edges.length);
    container.dataset.drawn = String(Number(container.dataset.drawn || 0) + 1);
    return picture;
  };
})((window.AttnscopeRoutes = window.AttnscopeRoutes || {}));
