// promql-names: Prometheus's own PromQL parser (github.com/prometheus/prometheus/promql/parser)
// over the expressions on stdin (a JSON list of strings), printing a JSON list with, for each,
// the metric names its selectors name, or the parser's error. Test harness only:
// tests/chart/test_alerts.py checks the chart's alert and dashboard queries with it
// (hack/promql/build builds it into the user's cache dir). Nothing in the product imports Go.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
)

type result struct {
	Names []string `json:"names"`
	Error string   `json:"error,omitempty"`
}

func main() {
	var exprs []string
	if err := json.NewDecoder(os.Stdin).Decode(&exprs); err != nil {
		fmt.Fprintln(os.Stderr, "promql-names: stdin is not a JSON list of strings:", err)
		os.Exit(2)
	}
	out := make([]result, 0, len(exprs))
	for _, text := range exprs {
		expr, err := parser.ParseExpr(text)
		if err != nil {
			out = append(out, result{Names: []string{}, Error: err.Error()})
			continue
		}
		seen := map[string]bool{}
		parser.Inspect(expr, func(node parser.Node, _ []parser.Node) error {
			if vs, ok := node.(*parser.VectorSelector); ok {
				for _, m := range vs.LabelMatchers {
					if m.Name == labels.MetricName && m.Type == labels.MatchEqual {
						seen[m.Value] = true
					}
				}
			}
			return nil
		})
		names := make([]string, 0, len(seen))
		for n := range seen {
			names = append(names, n)
		}
		sort.Strings(names)
		out = append(out, result{Names: names})
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		os.Exit(1)
	}
}
