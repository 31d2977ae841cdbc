"""Capacity policies in the cluster simulator's loop (:mod:`.sim`, :mod:`.autoscaling`,
:mod:`.diurnal`, :mod:`.report`) and the ILP solve-time benchmark (:mod:`.bench`)."""
